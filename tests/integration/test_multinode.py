"""Multi-node, on a real Ray cluster of three raylets on this machine (tests/helpers.py
`multinode_serve`: a head with no CPUs for replicas, as the chart's head, and two workers of one
CPU each, so each worker holds one replica): replicas spread over the workers, a tensor-parallel
replica's ranks share a node (and answer like the tp=1 engine; a dead rank fails the stream and
the health check), the ingress stays on the head; a worker node killed mid-load
loses no stream (each of its streams migrates to the survivor and completes, with the text an
undisturbed run gets), the survivor keeps serving, the routers, KV index and metrics forget the dead replica, and a node that joins later
takes the replacement; with autoscaling, a scale-up lands on a node that joined after the
application started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cluster.app import build_app  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import free_port, multinode_serve, sse_data  # noqa: E402

APP = "multinode"
# tokens per long stream (the model's 512 less the prompt's 8, and room): a second or more of
# decoding, so the kill lands mid-stream
LONG = 480


@pytest.fixture(scope="module")
def nodes():
    port = free_port()
    with multinode_serve(port, workers=2, worker_cpus=1.0) as cluster:
        yield {"cluster": cluster, "url": f"http://127.0.0.1:{port}", "port": port}


def deploy(model_dir, port: int, name: str = APP, **overrides) -> None:
    config = ClusterConfig.model_validate(
        {
            "name": name,
            "engine": {
                "model": str(model_dir),
                "max_model_len": 512,
                "max_num_batched_tokens": 256,
                "num_kv_blocks": 256,
                "block_size": 16,
            },
            "replicas": 2,
            "num_cpus_per_replica": 1.0,  # a worker holds one replica
            "http": {"host": "127.0.0.1", "port": port},
            "routing": {"stats_period_s": 0.5},
        }
        | overrides
    )
    serve.run(build_app(config), name=name, route_prefix="/")


def replica_counts(name: str = APP) -> dict[str, int]:
    return helpers.llm_replica_states(name)


def wait_running(n: int, name: str = APP, timeout_s: float = 120) -> None:
    helpers.wait_llm_replicas_running(name, n, timeout_s)


def body(tokens: int, seed: int, stream: bool) -> dict:
    prompt = [(seed * 7 + j) % 250 + 3 for j in range(8)]
    out = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    stream_fields = {"stream": True, "stream_options": {"include_usage": True}}
    return out | (stream_fields if stream else {})


async def stream(client: httpx.AsyncClient, url: str, seed: int) -> dict:
    """A long stream read to its end: status, completion tokens (its usage), its text, the
    error event if any, whether [DONE] came."""
    result = {"seed": seed, "status": None, "tokens": None, "text": "", "error": None,
              "done": False}  # fmt: skip
    async with client.stream("POST", f"{url}/v1/completions", json=body(LONG, seed, True)) as r:
        result["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            return result
        async for data in sse_data(r):
            if data == "[DONE]":
                result["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                result["error"] = event["error"]["message"]
            else:
                result["text"] += "".join(c["text"] for c in event["choices"])
                if event.get("usage"):
                    result["tokens"] = event["usage"]["completion_tokens"]
    return result


def ingress_stats(name: str = APP) -> dict:
    handle = serve.get_deployment_handle("Ingress", app_name=name)
    return handle.stats.remote().result(timeout_s=30)


TP_ENGINE = {
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 32,  # prompts arrive in chunks: chunked prefill across ranks
    "num_kv_blocks": 128,
    "block_size": 8,
}
PROMPTS = [
    "The quick brown fox",
    "A block table maps each request's positions to the blocks it holds, so memory is never "
    "fragmented and the key and value vectors",
    "Numbers such as 12",
]


def rank_workers() -> list[dict]:
    from ray._private.state import actors

    return [
        a
        for a in actors().values()
        if a["ActorClassName"] == "RayRankWorker" and a["State"] == "ALIVE"
    ]


def test_a_tp2_replica_packs_on_one_worker_answers_like_tp1_and_fails_when_a_rank_dies(
    nodes, tiny_llama_dir
):
    """A tp=2 replica: rank 0 in the replica actor, rank 1 a Ray actor in the replica's
    two-bundle STRICT_PACK placement group, both on one worker node; it answers HTTP like the
    offline tp=1 engine, and when its worker rank dies the in-flight stream ends with an error
    and the replica fails its health check."""
    from replica.engine import LLM
    from replica.request import SamplingParams

    cluster, url, name = nodes["cluster"], nodes["url"], "multinode-tp"
    workers = {n.node_id for n in cluster.workers}
    engine = {"model": str(tiny_llama_dir), **TP_ENGINE, "tensor_parallel_size": 2}
    deploy(tiny_llama_dir, nodes["port"], name, replicas=1, num_cpus_per_replica=0.5,
           engine=engine)  # fmt: skip
    try:
        groups = [
            pg
            for pg in ray.util.placement_group_table().values()
            if pg["state"] == "CREATED" and len(pg["bundles"]) == 2
        ]
        assert len(groups) == 1, groups
        assert groups[0]["strategy"] == "STRICT_PACK"
        rank_nodes = set(groups[0]["bundles_to_node_id"].values())
        assert len(rank_nodes) == 1 and rank_nodes <= workers, (rank_nodes, workers)
        (worker,) = rank_workers()
        assert worker["Address"]["NodeID"] in rank_nodes

        async def complete_all() -> list[dict]:
            async with httpx.AsyncClient(timeout=120) as client:
                responses = await asyncio.gather(
                    *(
                        client.post(
                            f"{url}/v1/completions",
                            json={
                                "prompt": p,
                                "max_tokens": 16,
                                "temperature": 0,
                                "ignore_eos": True,
                            },
                        )  # fmt: skip
                        for p in PROMPTS
                    )
                )
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
            return [r.json()["choices"][0]["text"] for r in responses]

        texts = asyncio.run(complete_all())
        offline = LLM(model=str(tiny_llama_dir), **TP_ENGINE, device="cpu")
        try:
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            assert texts == [o.text for o in offline.generate(PROMPTS, params)]
        finally:
            offline.shutdown()

        events: list[dict] = []
        started = None
        long = {"prompt": "The key and value", "max_tokens": 480, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[len("data: ") :]))
                if started is None:  # generation is under way: take rank 1 down
                    os.kill(worker["Pid"], signal.SIGKILL)
                    started = time.monotonic()
        assert time.monotonic() - started < 30
        assert "error" in events[-1], events[-1]
        finishes = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
        assert "length" not in finishes
        handle = serve.get_deployment_handle("LLMServer", app_name=name)
        with pytest.raises(Exception, match="rank 1"):
            handle.check_health.remote().result(timeout_s=30)
    finally:
        serve.delete(name)


def test_replicas_spread_over_the_workers_and_the_ingress_stays_on_the_head(nodes, tiny_llama_dir):
    """Two replicas of one CPU each: one per worker (Serve spreads them; each worker fits
    one); the ingress on the head node."""
    cluster = nodes["cluster"]
    deploy(tiny_llama_dir, nodes["port"])
    wait_running(2)
    stats = helpers.replica_stats(APP, 2)
    assert {s["node_id"] for s in stats.values()} == {n.node_id for n in cluster.workers}, stats
    assert ingress_stats()["node_id"] == cluster.head_id


def test_a_lost_worker_nodes_streams_migrate_and_complete_and_a_new_node_takes_the_replacement(
    nodes, tiny_llama_dir
):
    cluster, url = nodes["cluster"], nodes["url"]
    wait_running(2)
    migrated_before = ingress_stats()["migrations"]["lost"]
    stats = helpers.replica_stats(APP, 2)
    node_of = {rid: s["node_id"] for rid, s in stats.items()}
    n_streams = 8

    async def scenario():
        # n_streams keepers each run long streams back to back until the kill, so both
        # replicas hold streams at the kill however fast this host decodes (a fixed batch of
        # streams could all end before a poll saw both replicas running: a CI run on a fast
        # host decoded 480 tokens in 1.5-2 s and its poll missed them)
        killed = asyncio.Event()
        runs: list[tuple[bool, dict]] = []  # (ended after the kill, result) of every stream

        async def keeper(k: int) -> None:
            seed = k
            while not killed.is_set():
                result = await stream(client, url, seed)
                runs.append((killed.is_set(), result))
                # before the kill every stream completes: a failure fails the test at once
                ok = result["done"] and result["error"] is None and result["tokens"] == LONG
                assert killed.is_set() or ok, result
                seed += n_streams

        async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
            keepers = [asyncio.ensure_future(keeper(k)) for k in range(n_streams)]
            # both replicas decoding before the kill
            deadline = time.monotonic() + 90
            while True:
                now = await asyncio.to_thread(helpers.replica_stats, APP, 2)
                if len(now) == 2 and all(s["running"] > 0 for s in now.values()):
                    break
                assert time.monotonic() < deadline, (now, runs)
                for k in keepers:
                    if k.done():
                        k.result()  # a keeper's failure, with its own traceback
                await asyncio.sleep(0.1)
            victim = max(now.values(), key=lambda s: s["running"])
            killed.set()
            killed_at = time.monotonic()
            await asyncio.to_thread(cluster.kill, victim["node_id"])
            # new requests while the streams end: every one is served (by the survivor)
            after = []
            for i in range(10):
                r = await client.post(f"{url}/v1/completions", json=body(4, 100 + i, False))
                after.append((time.monotonic() - killed_at, r.status_code, r.text[:200]))
            await asyncio.wait_for(asyncio.gather(*keepers), timeout=120)
            return victim, after, runs, time.monotonic() - killed_at

    victim, after, runs, ended_s = asyncio.run(scenario())
    survivor = next(rid for rid in node_of if rid != victim["replica_id"])
    # the streams that ended before the kill completed (each keeper checked its own); those in
    # flight at the kill completed too: the victim's moved to the survivor (http.migration_limit)
    results = [r for after_kill, r in runs if after_kill]
    assert len(results) == n_streams, results
    for r in results:
        assert r["status"] == 200 and r["done"] and r["error"] is None, r | {"text": "..."}
    # which stream ran where is not visible to a client, and streams arriving when the stats
    # were read may have joined the victim before the kill: so not an exact count
    assert ingress_stats()["migrations"]["lost"] > migrated_before, "no stream migrated"
    assert ended_s < 90, ended_s
    assert all(status == 200 for _, status, _ in after), after
    # the dead replica is gone from Serve, the routers' tallies, the KV index and the metrics
    dead = victim["replica_id"]
    deadline = time.monotonic() + 60
    while True:
        state = ingress_stats()
        tallied = {rid for router in state["routers"] for rid in router.get("replicas", {})}
        indexed = {rid for index in kv_index() for rid in index}
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        if dead not in tallied and dead not in indexed and f'replica="{dead}"' not in metrics:
            break
        assert time.monotonic() < deadline, (tallied, indexed)
        time.sleep(0.5)
    assert f'replica="{survivor}"' in metrics
    # no worker has room for the replacement (one CPU each): it waits for a node. Serve's
    # controller counts the dead replica RUNNING until its own health check fails it, which
    # can come after the routers dropped it (a busy host): wait for that first
    deadline = time.monotonic() + 60
    while replica_counts().get("RUNNING") != 1:
        assert time.monotonic() < deadline, replica_counts()
        time.sleep(0.5)
    time.sleep(2)
    assert replica_counts().get("RUNNING") == 1, replica_counts()
    joined = cluster.add_worker()
    wait_running(2)
    stats = helpers.replica_stats(APP, 2)
    assert {s["node_id"] for s in stats.values()} == {node_of[survivor], joined.node_id}
    r = httpx.post(f"{url}/v1/completions", json=body(4, 7, False), timeout=60)
    assert r.status_code == 200, r.text
    # each stream that lived through the kill has the text and usage of the same request run
    # undisturbed (greedy): waits for the engine branch (replicas that honour `resume`)

    async def undisturbed():
        async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
            return await asyncio.gather(*(stream(client, url, r["seed"]) for r in results))

    for r, ref in zip(results, asyncio.run(undisturbed()), strict=True):
        assert ref["tokens"] == LONG and ref["error"] is None, ref
        assert r["text"] == ref["text"], (r["seed"], len(r["text"]), len(ref["text"]))
        assert r["tokens"] == LONG, r["tokens"]


def kv_index() -> list[dict]:
    handle = serve.get_deployment_handle("Ingress", app_name=APP)
    return handle.kv_index.remote().result(timeout_s=30)


def test_a_scale_up_lands_on_a_node_that_joined_after_the_app_started(nodes, tiny_llama_dir):
    """The application turns to autoscaling (2..3 replicas; Serve applies it to the running
    replicas in place); a queue-depth load asks for a third replica, which waits for room
    until a new node joins, then starts there."""
    cluster, url = nodes["cluster"], nodes["url"]
    wait_running(2)
    scaling = {"enabled": True, "min_replicas": 2, "max_replicas": 3, "target_queue_depth": 1.0,
               "upscale_delay_s": 0.5, "downscale_delay_s": 600, "look_back_period_s": 2.0,
               "metrics_interval_s": 0.5}  # fmt: skip
    deploy(tiny_llama_dir, nodes["port"], autoscaling=scaling)
    wait_running(2)
    before = {n.node_id for n in cluster.workers}
    stop = threading.Event()

    def load() -> None:  # 12 long streams until stopped (the main thread adds the node)
        async def streams() -> None:
            async with httpx.AsyncClient(timeout=httpx.Timeout(180)) as client:
                tasks = [asyncio.ensure_future(stream(client, url, i)) for i in range(12)]
                while not stop.is_set():
                    await asyncio.sleep(0.2)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(streams())

    loader = threading.Thread(target=load)
    loader.start()
    try:
        deadline = time.monotonic() + 90  # the third replica is asked for; no node has room
        while sum(replica_counts().values()) < 3:
            assert time.monotonic() < deadline, replica_counts()
            time.sleep(0.5)
        assert replica_counts().get("RUNNING") == 2, replica_counts()
        joined = cluster.add_worker()
        wait_running(3, timeout_s=90)
        stats = helpers.replica_stats(APP, 3)
    finally:
        stop.set()
        loader.join(timeout=120)
    assert joined.node_id not in before
    assert joined.node_id in {s["node_id"] for s in stats.values()}, (joined.node_id, stats)


def test_serve_address_joins_the_cluster_and_removes_only_its_application(
    nodes, tiny_llama_dir, tmp_path
):
    """`stepserve serve --address` deploys onto the running multi-node cluster (its replicas on
    the workers), says where that cluster's Serve listens, and on SIGINT deletes only its own
    application: the cluster, Serve and the other nodes stay up."""
    cluster, url = nodes["cluster"], nodes["url"]
    serve.delete(APP)  # the route prefix "/" is the new application's
    log = tmp_path / "serve.log"
    other_port = free_port()  # asked for, but this cluster's Serve already listens elsewhere
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--address", cluster.cluster.address,
           "--model", str(tiny_llama_dir), "--replicas", "1", "--port", str(other_port),
           "--num-cpus-per-replica", "1", "--num-kv-blocks", "128"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "ready at" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert f"ready at {url}/v1" in log.read_text(), log.read_text()[-2000:]
        r = httpx.post(f"{url}/v1/completions", json=body(4, 3, False), timeout=60)
        assert r.status_code == 200, r.text
        stats = helpers.replica_stats("stepserve", 1)
        assert {s["node_id"] for s in stats.values()} <= {n.node_id for n in cluster.workers}
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    assert code == 0, log.read_text()[-3000:]
    assert "stepserve" not in serve.status().applications
    assert len([n for n in ray.nodes() if n["Alive"]]) == 1 + len(cluster.workers)
