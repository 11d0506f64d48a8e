"""The direct feed end to end (router/feed.py, replica/feed.py): two applications of the tiny
llama on the shared Ray Serve, one with http.direct_stream on, one with it off (the default),
through real HTTP and the official openai client. Streams are token-identical either way (n=2
too), the feed carried the tokens where it is on and nothing where it is off, and a client that
leaves a fed stream aborts its request in the replica."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve.api import RunTarget  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.helpers import sse_data, wait_apps_running  # noqa: E402

ON, OFF = "stepserve-feed-on", "stepserve-feed-off"
MAX_MODEL_LEN = 512  # the tiny llama's positions
PROMPTS = [[(11 * i + j) % 250 + 3 for j in range(6 + 3 * i)] for i in range(3)]


def config(app: str, port: int, model_dir, direct_stream: bool) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "name": app,
            "engine": {
                "model": str(model_dir),
                "max_model_len": MAX_MODEL_LEN,
                "max_num_batched_tokens": 256,
                "num_kv_blocks": 160,
                "block_size": 16,
            },
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port, "direct_stream": direct_stream},
        }
    )


@pytest.fixture(scope="module")
def urls(tiny_llama_dir, shared_serve):
    targets = [
        RunTarget(
            build_app(config(app, shared_serve.port, tiny_llama_dir, on)),
            name=app,
            route_prefix=f"/{prefix}",
        )
        for app, prefix, on in ((ON, "on", True), (OFF, "off", False))
    ]
    serve.run_many(targets, wait_for_applications_running=False)
    wait_apps_running([ON, OFF], timeout_s=300)
    yield {ON: f"{shared_serve.url}/on", OFF: f"{shared_serve.url}/off"}


def ingress_feed(app: str) -> dict | None:
    stats = serve.get_deployment_handle("Ingress", app_name=app).stats.remote().result(timeout_s=30)
    return stats["feed"]


def llm_stats(app: str) -> dict:
    return (
        serve.get_deployment_handle("LLMServer", app_name=app).stats.remote().result(timeout_s=30)
    )


def streamed(url: str, prompt: list[int], max_tokens: int, n: int = 1) -> dict[int, dict]:
    """One greedy streamed completion read to [DONE]: per choice, its token ids and text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "n": n, "return_token_ids": True}  # fmt: skip
    choices: dict[int, dict] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for event in map(json.loads, lines[:-1]):
        assert "error" not in event, event
        for c in event["choices"]:
            got = choices.setdefault(c["index"], {"ids": [], "text": "", "finish": None})
            got["ids"] += c.get("token_ids") or []
            got["text"] += c["text"]
            got["finish"] = c["finish_reason"] or got["finish"]
    return choices


def test_streams_over_the_feed_equal_streams_over_ray_token_for_token(urls):
    from openai import OpenAI

    fed_before = ingress_feed(ON)
    for prompt in PROMPTS:
        on, off = streamed(urls[ON], prompt, 40), streamed(urls[OFF], prompt, 40)
        assert on == off and len(on[0]["ids"]) == 40 and on[0]["finish"] == "length"
        pair = streamed(urls[ON], prompt, 40, n=2)  # two calls fed at once, one stream
        assert pair[0] == pair[1] == on[0]
    chats = {}
    for app in (ON, OFF):
        client = OpenAI(base_url=f"{urls[app]}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chats[app] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert chats[ON] == chats[OFF] and chats[ON]
    # the tokens went over the feed where it is on (3 x (40 + 2 x 40) + 24 outputs at most,
    # fewer where a step's deltas merged), and there is none where it is off
    fed = ingress_feed(ON)
    grown = fed["outputs"] - (fed_before["outputs"] if fed_before else 0)
    assert 100 <= grown <= 3 * 120 + 24, fed
    assert fed["refused"] == 0 and fed["open_calls"] == 0
    assert ingress_feed(OFF) is None
    assert llm_stats(ON)["feed_fallbacks"] == 0


def generated_tokens(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:generation_tokens_total"
    )


def test_a_client_that_leaves_a_fed_stream_aborts_it_in_the_replica(urls):
    from replica.deployment import METRICS_PUSH_PERIOD_S

    url = urls[ON]
    time.sleep(METRICS_PUSH_PERIOD_S * 2)
    before = generated_tokens(url)
    outputs_before = ingress_feed(ON)["outputs"]
    max_tokens = MAX_MODEL_LEN - 8  # ~500 steps: far more than the client waits for
    body = {"prompt": [5] * 8, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip

    async def leave_after_three_events() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for data in sse_data(r):
                    assert "error" not in data
                    seen += 1
                    if seen == 3:
                        break  # the connection closes

    asyncio.run(leave_after_three_events())
    deadline = time.monotonic() + 30
    while True:  # the request is gone from the replica and its blocks are free
        stats = llm_stats(ON)
        if stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_kv_blocks"]:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    time.sleep(METRICS_PUSH_PERIOD_S * 3)
    generated = generated_tokens(url) - before
    assert 0 < generated < max_tokens, f"{generated} tokens: the request was not aborted"
    assert ingress_feed(ON)["outputs"] > outputs_before  # it was fed
