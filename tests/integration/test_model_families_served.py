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

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.helpers import free_port, loopback_serve  # noqa: E402
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


def test_each_family_is_served_over_http_token_identical_to_transformers(family_dirs):
    port = free_port()
    with loopback_serve(port) as url:
        for name in FAMILIES:
            config = ClusterConfig.model_validate(
                {
                    "name": APP,
                    "engine": {
                        "model": str(family_dirs[name]),
                        "max_model_len": 128,
                        "num_kv_blocks": 64,
                        "block_size": 4,
                    },
                    "replicas": 1,
                    "num_cpus_per_replica": 0.5,
                    "http": {"host": "127.0.0.1", "port": port},
                }
            )
            serve.run(build_app(config), name=APP, route_prefix="/")
            body = {
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, (name, r.text)
            served = r.json()["choices"][0]["token_ids"]
            expected = hf_greedy(family_dirs[name], tuple(PROMPT), MAX_TOKENS, stop_at_eos=False)
            assert served == expected, name
