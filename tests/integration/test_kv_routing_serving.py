"""KV-event routing on a real cluster: two replicas publish their prefix-cache events, the
ingress's router mirrors them. After a workload with evictions the index equals each replica's
own table (zero drift), the router's predicted hits equal the replica's reported hits when
nothing was evicted in between, and a replica that dies leaves the index."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from replica.hub import HUB_NAMESPACE, hub_name  # noqa: E402
from tests.helpers import replica_actor_names  # noqa: E402

APP = "kv-routing-test"


def _config(model_dir, port: int) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "name": APP,
            "engine": {
                "model": str(model_dir),
                "max_model_len": 256,
                "max_num_seqs": 4,
                "max_num_batched_tokens": 64,
                "num_kv_blocks": 24,  # 384 tokens: the workload below evicts
            },
            "replicas": 2,
            "num_cpus_per_replica": 0.5,
            "http": {"port": port},
            "routing": {"policy": "load_aware", "kv_events": True, "stats_period_s": 0.25},
        }
    )


def _replica_tables() -> dict[str, dict]:
    """Each replica's own cached-hash table and event counters, by replica id."""
    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    seen: dict[str, dict] = {}
    for _ in range(60):
        state = handle.kv_events_state.remote().result(timeout_s=60)
        seen[state["replica_id"]] = state
        if len(seen) >= 2:
            break
    return seen


def _index() -> dict[str, dict]:
    ingress = serve.get_deployment_handle("Ingress", app_name=APP)
    (routers,) = ingress.kv_index.remote().result(timeout_s=60)  # one router in the ingress
    return routers


def _settled(timeout_s: float = 30.0) -> tuple[dict, dict]:
    """The replicas' tables and the index, once every view has caught up with its replica
    (the index polls the hub every 50 ms; replicas publish every 20 ms)."""
    deadline = time.time() + timeout_s
    while True:
        tables, index = _replica_tables(), _index()
        caught_up = set(index) == set(tables) and all(
            index[rid]["seq"] == t["snapshot_seq"] for rid, t in tables.items()
        )
        if caught_up or time.time() > deadline:
            return tables, index
        time.sleep(0.5)


def _metric(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def _send(url: str, prompts: list[list[int]], max_tokens: int = 6) -> None:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(p):
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text

        await asyncio.gather(*(one(p) for p in prompts))


def test_kv_index_mirrors_replicas_predicts_hits_and_forgets_the_dead(tiny_llama_dir, shared_serve):
    port = shared_serve.port
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 500) for _ in range(48)] for _ in range(4)]
    serve.run(build_app(_config(tiny_llama_dir, port)), name=APP, route_prefix="/")
    # a mixed workload: shared prefixes, unique tails, more blocks than fit (evictions)
    for _ in range(3):
        prompts = [
            rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(rng.randint(1, 40))]
            for _ in range(12)
        ]
        asyncio.run(_send(url, prompts))
    tables, index = _settled()
    assert len(tables) == 2
    for state in tables.values():
        assert state["events"] > state["blocks"], "the workload must evict"
    assert set(index) == set(tables), (set(index), set(tables))
    for rid, state in tables.items():
        assert index[rid]["seq"] == state["snapshot_seq"]
        assert set(index[rid]["hashes"]) == set(state["hashes"])  # zero drift

    # sequential requests: nothing is evicted between a prediction and the admission
    before_exact = _metric(url, "stepserve:router_hit_predictions_total", outcome="exact")
    before_diff = _metric(url, "stepserve:router_hit_predictions_total", outcome="different")
    for _ in range(6):
        prompt = rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(8)]
        asyncio.run(_send(url, [prompt]))
        time.sleep(0.3)  # the events reach the index before the next request
    exact = _metric(url, "stepserve:router_hit_predictions_total", outcome="exact") - before_exact
    diff = _metric(url, "stepserve:router_hit_predictions_total", outcome="different") - before_diff
    assert exact == 6 and diff == 0, (exact, diff)
    assert _metric(url, "stepserve:router_actual_hit_tokens_total") > 0
    assert _metric(url, "stepserve:router_kv_events_total") > 0
    decisions = _metric(url, "stepserve:router_decisions_total")
    assert decisions >= 6
    # one hub actor per application carries both the KV events and the replicas' metrics
    hubs = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == HUB_NAMESPACE
    ]
    assert hubs == [hub_name(APP)], hubs
    for rid in tables:  # each replica's exposition reached /metrics through it
        assert _metric(url, "vllm:generation_tokens_total", replica=rid) > 0, rid

    # a replica dies: the router drops it from the index as soon as Serve says so
    victim = sorted(tables)[0]
    ray.kill(ray.get_actor(replica_actor_names(APP)[victim], namespace="serve"), no_restart=True)
    deadline = time.time() + 60
    while victim in _index() and time.time() < deadline:
        time.sleep(0.5)
    assert victim not in _index()
    asyncio.run(_send(url, [prefixes[0] + [11, 12]]))  # the survivor serves
