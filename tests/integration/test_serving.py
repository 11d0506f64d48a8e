"""Serving on loopback: a real Ray Serve app (ingress + 2 replicas of a tiny model), real HTTP,
the official openai client; outputs compared with the offline engine."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests import helpers  # noqa: E402

APP = "stepserve-test"
MAX_MODEL_LEN = 256


def engine_fields(model_dir) -> dict:
    return {
        "model": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 128,
        "num_kv_blocks": 96,
        "block_size": 16,
    }


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, shared_serve):
    port = shared_serve.port
    config = ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": engine_fields(tiny_llama_dir),
            "replicas": 2,
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port},
            "routing": {"stats_period_s": 0.5},
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


def greedy_offline(offline, prompt_ids: list[int], max_tokens: int) -> list[int]:
    from replica.request import SamplingParams

    (out,) = offline.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0))
    return out.output_token_ids, out.text


def replica_stats() -> dict[str, dict]:
    return helpers.replica_stats(APP, n_replicas=2, max_calls=24)


def test_completion_matches_offline_engine(cluster, offline):
    prompt = "The quick brown fox"
    r = httpx.post(
        f"{cluster['url']}/v1/completions",
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = offline.tokenizer.encode(prompt)
    _, text = greedy_offline(offline, ids, 12)
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 12,
        "total_tokens": len(ids) + 12,
    }


def test_streaming_completion_sse_with_usage(cluster, offline):
    ids = [5, 6, 7, 8, 9, 10]
    chunks = []
    with httpx.stream(
        "POST",
        f"{cluster['url']}/v1/completions",
        json={
            "prompt": ids,
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    _, expected = greedy_offline(offline, ids, 10)
    assert text == expected
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 10
    assert events[-1]["usage"]["prompt_tokens"] == len(ids)


def test_openai_client_chat_and_completion(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster['url']}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == cluster["config"].model_name()
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant"
    assert 1 <= chat.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    comp = client.completions.create(model=model, prompt="abc", max_tokens=4, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length")


def test_32_concurrent_streams_match_offline(cluster, offline):
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 11)] for i in range(32)]
    max_tokens = [4 + (i * 5) % 17 for i in range(32)]

    async def one(client, ids, n):
        text = ""
        async with client.stream(
            "POST",
            f"{cluster['url']}/v1/completions",
            json={
                "prompt": ids,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text += event["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(one(client, p, n) for p, n in zip(prompts, max_tokens, strict=True))
            )

    texts = asyncio.run(main())
    for ids, n, text in zip(prompts, max_tokens, texts, strict=True):
        assert text == greedy_offline(offline, ids, n)[1]


def test_client_disconnect_frees_kv_blocks(cluster):
    with httpx.stream(
        "POST",
        f"{cluster['url']}/v1/completions",
        json={
            "prompt": [3] * 40,
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n >= 3:
                break  # leave mid-stream: the connection closes
    deadline = time.time() + 30
    while True:
        stats = replica_stats()
        if len(stats) == 2 and all(
            s["num_unfinished"] == 0 and s["num_free_blocks"] == s["num_kv_blocks"]
            for s in stats.values()
        ):
            break
        assert time.time() < deadline, f"KV blocks not freed after disconnect: {stats}"
        time.sleep(0.5)


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ("{not json", 400, "not valid JSON"),
        ({"prompt": "hi", "model": "nope"}, 404, "'nope' does not exist"),
        ({"prompt": "hi", "temperature": 3.5}, 400, "temperature must be in [0, 2], got 3.5"),
        ({"prompt": [1] * 250, "max_tokens": 10}, 400, f"max_model_len={MAX_MODEL_LEN}"),
        ({"prompt": [10**6], "max_tokens": 1}, 400, "outside the vocabulary"),
        ({"prompt": "", "max_tokens": 1}, 400, "prompt must not be empty"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_errors(cluster, body, status, needle):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{cluster['url']}/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    # OpenAI's own code where it has one (an unknown model), else the HTTP status (as vLLM)
    assert err["code"] == ("model_not_found" if status == 404 else status)


def test_prompt_plus_max_tokens_error_names_both_numbers(cluster):
    r = httpx.post(
        f"{cluster['url']}/v1/completions",
        json={"prompt": [5] * 200, "max_tokens": 100},
        timeout=30,
    )
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "200" in msg and "100" in msg and str(MAX_MODEL_LEN) in msg


def test_health_and_models(cluster):
    assert httpx.get(f"{cluster['url']}/health", timeout=30).status_code == 200
    models = httpx.get(f"{cluster['url']}/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def scrape(url: str) -> dict[str, float]:
    """Sum every sample of /metrics over its labels except finished_reason/le -> {name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_metrics_counts_are_true(cluster):
    from replica.deployment import METRICS_PUSH_PERIOD_S

    # replicas push metrics about once a second: let earlier tests' tokens land first
    time.sleep(METRICS_PUSH_PERIOD_S * 3)
    before = scrape(cluster["url"])
    n_requests, completion_tokens = 6, 0
    for i in range(n_requests):
        r = httpx.post(
            f"{cluster['url']}/v1/completions",
            json={"prompt": [4 + i] * (3 + i), "max_tokens": 3 + i, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200
        completion_tokens += r.json()["usage"]["completion_tokens"]
    time.sleep(METRICS_PUSH_PERIOD_S * 3)
    after = scrape(cluster["url"])

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm:generation_tokens_total") == completion_tokens
    assert delta("vllm:request_success_total") == n_requests
    assert delta("vllm:time_to_first_token_seconds_count") == n_requests
    assert delta("vllm:e2e_request_latency_seconds_count") == n_requests
    scheduler_preemptions = sum(s["num_preemptions_total"] for s in replica_stats().values())
    assert after.get("vllm:num_preemptions_total", 0.0) == scheduler_preemptions
    # both replicas report, each under its own label
    text = httpx.get(f"{cluster['url']}/metrics", timeout=30).text
    replicas = {
        line.split('replica="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running{")
    }
    assert len(replicas) == 2


def test_two_ingress_replicas_serve_concurrent_requests(cluster, tiny_llama_dir, offline):
    """http.ingress_replicas: the HTTP ingress (validation, tokenization, SSE) scales apart from
    the engines; every request is answered whichever ingress replica the proxy picks."""
    app = "wide-ingress"
    config = ClusterConfig.model_validate(
        {
            "name": app,
            "engine": engine_fields(tiny_llama_dir),
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "http": {**cluster["config"].http.model_dump(), "ingress_replicas": 2},
        }
    )
    serve.run(build_app(config), name=app, route_prefix="/wide")
    try:
        ingress = serve.status().applications[app].deployments["Ingress"]
        assert dict(ingress.replica_states) == {"RUNNING": 2}
        prompts = [[5 + i, 6, 7, 8] for i in range(8)]

        async def one(client: httpx.AsyncClient, ids: list[int]) -> list[int]:
            r = await client.post(
                f"{cluster['url']}/wide/v1/completions",
                json={"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        async def all_of_them() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client, ids) for ids in prompts))

        texts = asyncio.run(all_of_them())
        assert texts == [greedy_offline(offline, ids, 6)[1] for ids in prompts]
    finally:
        serve.delete(app)
