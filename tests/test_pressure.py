"""Honest under pressure, over real Ray Serve and HTTP: a burst of high-priority requests gets
ahead of a full replica's low-priority ones; a replica whose engine hangs reports unhealthy, its
streams end with an error, Serve replaces it and new requests are served."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests.helpers import free_port, loopback_serve, sse_data  # noqa: E402


@pytest.fixture(scope="module")
def ray_serve():
    port = free_port()
    with loopback_serve(port, env={"STEPSERVE_FAULT_INJECTION": "1"}) as url:
        yield {"url": url, "port": port}


def deploy(model_dir, port: int, name: str, **engine) -> None:
    config = ClusterConfig.model_validate(
        {
            "name": name,
            "engine": {
                "model": str(model_dir),
                "max_model_len": 512,
                "max_num_batched_tokens": 256,
                "num_kv_blocks": 128,
                "block_size": 16,
                **engine,
            },
            "replicas": 1,
            "num_cpus_per_replica": 0.5,
            "http": {"host": "127.0.0.1", "port": port},
        }
    )
    serve.run(build_app(config), name=name, route_prefix="/")


async def stream_completion(client, url, body) -> dict:
    """One streamed completion: its TTFT, tokens and how it ended (finish reason or error)."""
    start = time.monotonic()
    first = None
    tokens = 0
    result = {"finish": None, "error": None}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {**result, "error": f"HTTP {r.status_code}", "ttft": None, "tokens": 0}
        async for data in sse_data(r):
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result["error"] = event["error"]["message"]
                continue
            for choice in event["choices"]:
                if choice["text"] and first is None:
                    first = time.monotonic() - start
                tokens += len(choice.get("token_ids") or [])
                result["finish"] = choice["finish_reason"] or result["finish"]
    return {**result, "ttft": first, "tokens": tokens}


def test_high_priority_burst_gets_ahead_of_a_full_replica(ray_serve, tiny_llama_dir):
    """8 low-priority streams fill a replica of 4 seats (4 run, 4 wait); then 4 high-priority
    requests arrive: each takes a seat at once (preempting a low one), so their TTFT is a
    fraction of the waiting low-priority requests'; every request completes."""
    url = ray_serve["url"]
    deploy(tiny_llama_dir, ray_serve["port"], "pressure-priority", max_num_seqs=4)
    low = {"prompt": "The cache", "max_tokens": 300, "ignore_eos": True, "stream": True,
           "priority": 10, "return_token_ids": True, "temperature": 0}  # fmt: skip
    high = {**low, "max_tokens": 8, "priority": 0}

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            lows = [asyncio.ensure_future(stream_completion(client, url, low)) for _ in range(8)]
            await asyncio.sleep(1.0)  # the low ones are running and queued
            highs = [stream_completion(client, url, high) for _ in range(4)]
            return await asyncio.gather(*highs), await asyncio.gather(*lows)

    try:
        highs, lows = asyncio.run(main())
        for r in highs + lows:  # nothing lost: every request ran to its length
            assert r["error"] is None and r["finish"] == "length", r
        assert [r["tokens"] for r in highs] == [8] * 4
        assert [r["tokens"] for r in lows] == [300] * 8
        queued_lows = sorted(r["ttft"] for r in lows)[4:]  # the four that waited for a seat
        high_ttft = statistics.median(r["ttft"] for r in highs)
        assert high_ttft < 0.5 * statistics.median(queued_lows), (high_ttft, queued_lows)
    finally:
        serve.delete("pressure-priority")


def test_a_stalled_engine_is_unhealthy_its_streams_end_and_it_is_replaced(
    ray_serve, tiny_llama_dir
):
    url = ray_serve["url"]
    name = "pressure-stall"
    deploy(tiny_llama_dir, ray_serve["port"], name, max_num_seqs=8, stall_timeout_s=2.0)
    llm = serve.get_deployment_handle("LLMServer", app_name=name)
    before = llm.stats.remote().result()["replica_id"]
    body = {"prompt": "The cache", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}  # fmt: skip

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            streams = [
                asyncio.ensure_future(stream_completion(client, url, body)) for _ in range(3)
            ]
            await asyncio.sleep(0.5)
            started = time.monotonic()
            await asyncio.to_thread(lambda: llm.inject_stall.remote(600).result())
            results = await asyncio.gather(*streams)
            return results, time.monotonic() - started

    try:
        results, ended_after = asyncio.run(main())
        for r in results:  # each stream ends with an error event naming the stall, none hangs
            assert r["error"] is not None and "stalled" in r["error"], r
        assert ended_after < 30, ended_after  # stall_timeout_s 2 + Serve's 5 s health period
        deadline = time.monotonic() + 180
        replaced = None
        while time.monotonic() < deadline:  # Serve replaces the replica; requests are served
            try:
                r = httpx.post(
                    f"{url}/v1/completions",
                    json={"prompt": "hi", "max_tokens": 4, "temperature": 0},
                    timeout=30,
                )
                health = httpx.get(f"{url}/health", timeout=30)
            except httpx.HTTPError:
                r = health = None
            if r is not None and r.status_code == 200 and health.status_code == 200:
                replaced = llm.stats.remote().result()["replica_id"]
                if replaced != before:
                    break
            time.sleep(1)
        assert replaced is not None and replaced != before
        body = health.json()
        assert body["ready_replicas"] >= 1 and all(rep["ready"] for rep in body["replicas"])
    finally:
        serve.delete(name)
