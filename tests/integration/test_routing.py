"""Load-aware routing on loopback: with one replica deep in work (long queue, KV pressure,
preemptions), new requests go to the idle one."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402

APP = "routing-test"


def _config(model_dir, port: int) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": {
                "model": str(model_dir),
                "max_model_len": 512,
                "max_num_seqs": 2,
                "max_num_batched_tokens": 64,
                "num_kv_blocks": 40,
            },
            # a second replica is added by the autoscaler once the first one is deep in work
            "autoscaling": {
                "enabled": True,
                "min_replicas": 1,
                "max_replicas": 2,
                "target_queue_depth": 4,
                "upscale_delay_s": 0.5,
                "downscale_delay_s": 600,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 1.0,
            },
            "num_cpus_per_replica": 0.5,
            "http": {"port": port},
            "routing": {"policy": "load_aware", "stats_period_s": 0.25},
        }
    )


def _fixed_config(model_dir, port: int, replicas: int = 1) -> ClusterConfig:
    """`_config` without autoscaling: a fixed count of `replicas`."""
    config = _config(model_dir, port)
    autoscaling = config.autoscaling.model_copy(update={"enabled": False})
    return config.model_copy(update={"autoscaling": autoscaling, "replicas": replicas})


def _by_replica(url: str, sample_name: str) -> dict[str, float]:
    """One metric from /metrics summed per replica label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == sample_name:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0) + s.value
    return out


def _success_by_replica(url: str) -> dict[str, float]:
    return _by_replica(url, "vllm:request_success_total")


def _running(app: str) -> int:
    status = serve.status().applications[app].deployments["LLMServer"]
    return status.replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def serving(shared_serve):
    """One Ray and Serve for the module; each test deploys its application and deletes it."""
    port = shared_serve.port
    url = shared_serve.url
    yield port, url


def test_new_requests_avoid_the_busy_replica(serving, tiny_llama_dir):
    port, url = serving
    serve.run(build_app(_config(tiny_llama_dir, port)), name=APP, route_prefix="/")
    try:
        busy_handle = serve.get_deployment_handle("LLMServer", app_name=APP)
        busy_id = busy_handle.stats.remote().result(timeout_s=30)["replica_id"]

        async def scenario():
            async with httpx.AsyncClient(timeout=300) as client:
                # phase 1: one replica only, give it a deep queue of long requests
                long_tasks = [
                    asyncio.ensure_future(
                        client.post(
                            f"{url}/v1/completions",
                            json={
                                "prompt": [7 + i] * 60,
                                "max_tokens": 400,
                                "temperature": 0,
                                "ignore_eos": True,
                            },
                        )
                    )
                    for i in range(48)
                ]
                await asyncio.sleep(2.0)
                # phase 2: the autoscaler adds a second replica
                deadline = time.time() + 120
                while _running(APP) < 2:
                    assert time.time() < deadline
                    await asyncio.sleep(0.5)
                await asyncio.sleep(1.0)  # a few routing-stats periods
                waiting = _by_replica(url, "vllm:num_requests_waiting")
                running = _by_replica(url, "vllm:num_requests_running")
                assert waiting.get(busy_id, 0) + running.get(busy_id, 0) >= 8, (waiting, running)
                before = _success_by_replica(url)
                short = [
                    client.post(
                        f"{url}/v1/completions",
                        json={"prompt": [3 + i] * 5, "max_tokens": 4, "temperature": 0},
                    )
                    for i in range(12)
                ]
                results = []
                for i in range(0, 12, 3):  # a few at a time, as a steady stream
                    results += await asyncio.gather(*short[i : i + 3])
                assert all(r.status_code == 200 for r in results)
                await asyncio.sleep(3.0)  # replicas push metrics about once a second
                after = _success_by_replica(url)
                for task in long_tasks:
                    task.cancel()
                await asyncio.gather(*long_tasks, return_exceptions=True)
                return before, after

        before, after = asyncio.run(scenario())
        on_busy = after.get(busy_id, 0) - before.get(busy_id, 0)
        on_idle = sum(v - before.get(k, 0) for k, v in after.items() if k != busy_id)
        assert on_busy + on_idle >= 12
        assert on_idle >= 11, f"idle replica got {on_idle} of 12 short requests, busy {on_busy}"

    finally:
        serve.delete(APP)


def test_router_counts_prefill_until_the_ingress_sees_the_first_token(serving, tiny_llama_dir):
    """The ingress tells the router that routed a stream when its first token arrives; until
    then (or until the learned prefill rate says it must be done) its prompt counts as prefill
    still ahead on its replica, which the load-aware score weighs. The ingress also reports the
    end: Ray's own completion hook fires as the replica accepts a stream, which used to take
    every stream off the router's tally at once (the mid-stream count below was 0)."""
    port, url = serving
    config = _fixed_config(tiny_llama_dir, port)
    prompt = [11] * 24
    serve.run(build_app(config), name=APP, route_prefix="/")
    try:
        llm = serve.get_deployment_handle("LLMServer", app_name=APP)
        replica = llm.stats.remote().result(timeout_s=30)
        assert replica["max_num_batched_tokens"] == 64  # the step budget the score divides by
        ingress = serve.get_deployment_handle("Ingress", app_name=APP)
        body = {
            "prompt": prompt,
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            (router,) = ingress.stats.remote().result(timeout_s=30)["routers"]
            drained = [line for line in lines if line.startswith("data: ")]
        assert drained[-1] == "data: [DONE]"
        # mid-stream: one request of ours on the replica, no prefill ahead, a rate learned
        # from its first token (without the ingress's report it would count all 24 tokens)
        assert router["replicas"][replica["replica_id"]]["requests"] == 1, router
        assert router["replicas"][replica["replica_id"]]["prefill_tokens"] == 0, router
        assert router["prefill_rate"] > 0, router
        (router,) = ingress.stats.remote().result(timeout_s=30)["routers"]
        assert not router["replicas"], router  # finished: nothing left in the tally
    finally:
        serve.delete(APP)


def test_a_burst_is_spread_over_the_replicas(serving, tiny_llama_dir):
    """Eight requests sent at once to two idle replicas: Ray routes them in one pass and reports
    each routed only after its replica accepted it, so the router counts its choice at once
    (InflightLoad.chosen); otherwise each decision sees the same numbers (a random split at
    best, all eight on one replica when one report differs)."""
    port, url = serving
    config = _fixed_config(tiny_llama_dir, port, replicas=2)
    serve.run(build_app(config), name=APP, route_prefix="/")
    try:
        deadline = time.time() + 120
        while _running(APP) < 2:
            assert time.time() < deadline
            time.sleep(0.5)
        time.sleep(1.0)  # both replicas have recorded stats
        for _ in range(3):  # three bursts, each of eight requests at once
            before = _success_by_replica(url)

            async def burst():
                async with httpx.AsyncClient(timeout=120) as client:
                    return await asyncio.gather(
                        *(
                            client.post(
                                f"{url}/v1/completions",
                                json={
                                    "prompt": [5 + i] * 8,
                                    "max_tokens": 64,
                                    "temperature": 0,
                                    "ignore_eos": True,
                                },
                            )
                            for i in range(8)
                        )
                    )

            results = asyncio.run(burst())
            assert all(r.status_code == 200 for r in results), [r.text for r in results]
            deadline = time.time() + 30
            while True:  # replicas push metrics about once a second
                after = _success_by_replica(url)
                placed = {rid: after[rid] - before.get(rid, 0) for rid in after}
                if sum(placed.values()) >= 8:
                    break
                assert time.time() < deadline, placed
                time.sleep(0.5)
            assert len(placed) == 2 and min(placed.values()) >= 3, placed
    finally:
        serve.delete(APP)
