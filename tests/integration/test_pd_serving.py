"""PD disaggregation on a real cluster (cluster/app.py, router/fanout.py): a prefill deployment
beside the decode one, one replica each; through real HTTP and the official `openai` client, a
streamed and a unary completion each give the offline engine's greedy answer, their prompts ran
on the prefill replica and their continuations on the decode replica."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.integration.test_serving import engine_fields, greedy_offline  # noqa: E402

APP = "pd-test"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, shared_serve):
    port = shared_serve.port
    config = ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": engine_fields(tiny_llama_dir),
            "pd": {"prefill_replicas": 1, "decode_replicas": 1},
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port},
            "routing": {"stats_period_s": 0.5, "kv_transfer": True},
        }
    )
    url = shared_serve.url
    serve.run(build_app(config), name=APP, route_prefix="/")
    yield {"url": url, "config": config}


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    from replica.engine import LLM

    llm = LLM(**engine_fields(tiny_llama_dir))
    yield llm
    llm.shutdown()


def _queries(deployment: str) -> int:
    handle = serve.get_deployment_handle(deployment, app_name=APP)
    return handle.stats.remote().result(timeout_s=60)["prefix_cache_queries"]


def test_pd_streams_and_answers_as_one_replica_would(cluster, offline):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster['url']}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompt = "The quick brown fox jumps over the lazy dog and then"
    ids = offline.tokenizer.encode(prompt)
    _, expected = greedy_offline(offline, ids, 10)
    before = {name: _queries(name) for name in ("LLMServer-prefill", "LLMServer")}
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ids)
    unary = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert unary.choices[0].text == expected and unary.usage.completion_tokens == 10
    assert unary.choices[0].finish_reason == "length"
    after = {name: _queries(name) for name in before}
    # each request's prompt on the prefill replica, its continuation on the decode replica
    assert after["LLMServer-prefill"] - before["LLMServer-prefill"] == 2 * len(ids)
    assert after["LLMServer"] - before["LLMServer"] >= 2 * (len(ids) + 1)
