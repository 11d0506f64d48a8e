"""Every supported family served over HTTP: a tiny random checkpoint of each (windows shorter than
the prompt where the family has them) deployed as `stepserve serve --model DIR` deploys it (the
same ClusterConfig -> build_app), one greedy completion per family over real HTTP, its token ids
equal to transformers' greedy continuation."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve.api import RunTarget  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.helpers import wait_apps_running  # noqa: E402
from tests.replica.test_model_parity import hf_greedy  # noqa: E402

APP = "stepserve-families"
PROMPT = [5, 17, 33, 2, 48, 61, 9, 27, 14, 40, 8, 22, 51, 3, 36, 19, 44, 11, 29, 7]
MAX_TOKENS = 8


def _build(name: str, out, tokenizer_dir) -> None:
    if name in ("qwen3", "qwen3_moe", "mixtral", "olmoe"):
        from replica.tiny_models_moe import build_tiny_family

        window = {"mixtral": {"sliding_window": 8}}.get(name, {})
        build_tiny_family(out, tokenizer_dir, name, seed=51, **window)
    elif name in ("gemma2", "gemma3"):
        from replica.tiny_models_gemma import build_tiny_gemma

        build_tiny_gemma(out, tokenizer_dir, name, seed=52)
    elif name == "phi3":
        from replica.tiny_models_phi3_smollm3 import build_tiny_phi3

        build_tiny_phi3(out, tokenizer_dir, seed=53, sliding_window=8)
    else:
        from replica.tiny_models_phi3_smollm3 import build_tiny_smollm3

        build_tiny_smollm3(out, tokenizer_dir, seed=54, no_rope_layers=[1, 0, 1, 0])


FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "olmoe", "phi3", "smollm3", "gemma2", "gemma3"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_tokenizer_dir):
    dirs = {}
    for name in FAMILIES:
        dirs[name] = tmp_path_factory.mktemp(f"served-{name}")
        _build(name, dirs[name], tiny_tokenizer_dir)
    return dirs


def test_each_family_is_served_over_http_token_identical_to_transformers(family_dirs, shared_serve):
    """The families are deployed 4 at a time (4 replicas of half a CPU fill the 2-CPU cluster),
    each an application of its own as `stepserve serve --model DIR` makes it, on its own route:
    their replicas start side by side while transformers computes the expected tokens."""
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    for wave in (FAMILIES[:4], FAMILIES[4:]):
        apps = {name: f"{APP}-{name.replace('_', '-')}" for name in wave}
        targets = []
        for name, app in apps.items():
            config = ClusterConfig.model_validate(
                {
                    "name": app,
                    "engine": {
                        "model": str(family_dirs[name]),
                        "max_model_len": 128,
                        "num_kv_blocks": 64,
                        "block_size": 4,
                    },
                    "replicas": 1,
                    "num_cpus_per_replica": 0.5,
                    "http": {"host": "127.0.0.1", "port": shared_serve.port},
                }
            )
            targets.append(RunTarget(build_app(config), name=app, route_prefix=f"/{name}"))
        serve.run_many(targets, wait_for_applications_running=False)
        expected = {
            name: hf_greedy(family_dirs[name], tuple(PROMPT), MAX_TOKENS, stop_at_eos=False)
            for name in wave
        }
        wait_apps_running(list(apps.values()), timeout_s=600)
        for name in apps:
            r = httpx.post(f"{shared_serve.url}/{name}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, (name, r.text)
            assert r.json()["choices"][0]["token_ids"] == expected[name], name
        for app in apps.values():  # their CPUs go to the next wave's replicas
            serve.delete(app, _blocking=False)
