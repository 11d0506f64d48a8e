"""Soak: a few thousand mixed requests against a loopback cluster this script starts, with
random client disconnects and aborts, bad input, missing API keys and one replica killed
midway. At the end every request must be accounted for (completed, or a clear error: a 4xx
naming the problem, a 429 with Retry-After, or ended by the client on purpose), every KV block
free and no request state left in any replica or the ingress. The killed replica's streams
migrate to the survivor (http.migration_limit, --migration-limit): none may end "replica
failed" (a 503 or an error event) unless migration is off (--migration-limit 0), and the
ingress's migrations and retries are reported. Prints the figures and writes
bench/results/soak.json; exits 1 if anything is unaccounted, failed or leaked.

With --multinode the cluster is a head and one worker node per replica (several raylets on
this machine), and what dies is the busiest replica's whole node; a fresh node joins
--rejoin-after-s later, and the time back to full capacity is measured from the kill
(bench/results/soak_multinode.json).

Run: flock /tmp/stepserve-ray.lock .venv/bin/python bench/soak.py [--requests 3000] [--multinode]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._cluster import LocalCluster  # noqa: E402
from bench._models import model_dir  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from tests import helpers  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
APP = "stepserve-soak"
API_KEY = "sk-soak-local"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
VOCAB = 512  # the tiny model's; other models just see token ids < 512

# Outcomes. The first six are accounted for; "unexpected" (a hang, a 500, a 200 with a
# truncated answer, a 4xx for a good request, a broken connection we did not cause) is a defect.
COMPLETED = "completed"
REJECTED = "rejected_4xx"  # bad input or no key: the error names the problem
OVERLOADED = "overloaded_429"
REPLICA_FAILED = "replica_failed_503"
CLIENT_LEFT = "client_left"  # we disconnected or aborted on purpose
UNEXPECTED = "unexpected"

BAD_BODIES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}),
    ("/v1/completions", {"prompt": "hi", "temperature": 9}),
    ("/v1/completions", {"prompt": [1, 10**6]}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}),
    ("/v1/completions", {"prompt": [5] * 5000}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
]


def engine_fields(model: Path) -> dict:
    return {
        "model": str(model),
        "max_model_len": 1024,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "max_queue_len": 32,
        "num_kv_blocks": 128,  # small: preemptions happen too
        "block_size": 16,
    }


class Plan:
    """One request of the soak, drawn from the seeded RNG."""

    def __init__(self, index: int, rng: random.Random) -> None:
        self.index = index
        roll = rng.random()
        self.kind = (
            "bad"
            if roll < 0.08
            else "no_key"
            if roll < 0.10
            else "disconnect"
            if roll < 0.20
            else "abort"
            if roll < 0.27
            else "good"
        )
        self.chat = rng.random() < 0.3
        self.stream = rng.random() < 0.5
        self.n = 2 if rng.random() < 0.1 else 1
        self.max_tokens = rng.randint(1, 48)
        self.leave_after_events = rng.randint(1, 4)  # disconnect: events read before leaving
        self.abort_after_s = rng.uniform(0.0, 0.8)  # abort: the client task is cancelled
        prompt_len = rng.randint(1, 200)
        start = rng.randrange(VOCAB)
        self.prompt_ids = [(start + 7 * j) % (VOCAB - 3) + 3 for j in range(prompt_len)]
        self.bad = rng.choice(BAD_BODIES)

    def request(self) -> tuple[str, dict, dict]:
        """(path, body, headers)."""
        if self.kind == "bad":
            path, body = self.bad
            return path, dict(body), AUTH
        common = {"max_tokens": self.max_tokens, "n": self.n, "ignore_eos": True}
        if self.stream:
            common |= {"stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            text = " ".join(f"w{t}" for t in self.prompt_ids[:40])
            body = {"messages": [{"role": "user", "content": text}]} | common
            path = "/v1/chat/completions"
        else:
            body, path = {"prompt": self.prompt_ids} | common, "/v1/completions"
        return path, body, ({} if self.kind == "no_key" else AUTH)


def classify_status(plan: Plan, status: int, headers, body: dict) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if status == 429 and headers.get("retry-after") and error:
        return OVERLOADED
    if status == 503 and error and "replica failed" in error["message"]:
        return REPLICA_FAILED
    if 400 <= status < 500 and error and error.get("message"):
        expected = plan.kind in ("bad", "no_key")
        return REJECTED if expected else UNEXPECTED
    return UNEXPECTED


async def run_one(client: httpx.AsyncClient, url: str, plan: Plan) -> dict:
    path, body, headers = plan.request()
    t0 = time.monotonic()
    record = {"index": plan.index, "kind": plan.kind, "stream": plan.stream, "chat": plan.chat}
    leave = plan.kind == "disconnect"
    try:
        if not plan.stream or plan.kind in ("bad", "no_key"):
            r = await client.post(f"{url}{path}", json=body, headers=headers)
            data = r.json()
            if r.status_code == 200:
                choices, usage = data.get("choices", []), data.get("usage", {})
                complete = len(choices) == plan.n and all(c.get("finish_reason") for c in choices)
                ok = complete and usage.get("completion_tokens") == plan.n * plan.max_tokens
                outcome = COMPLETED if ok and plan.kind not in ("bad", "no_key") else UNEXPECTED
            else:
                outcome = classify_status(plan, r.status_code, r.headers, data)
            record |= {"status": r.status_code}
        else:
            record |= await read_stream(client, f"{url}{path}", body, headers, plan, leave)
            outcome = record.pop("outcome")
    except httpx.TimeoutException:
        outcome = UNEXPECTED
        record["error"] = "timeout (a hang)"
    except (httpx.HTTPError, ValueError) as exc:
        outcome = UNEXPECTED
        record["error"] = f"{type(exc).__name__}: {exc}"
    record |= {"outcome": outcome, "latency_s": time.monotonic() - t0}
    return record


async def read_stream(client, url, body, headers, plan: Plan, leave: bool) -> dict:
    events, error, done = 0, None, False
    finished, usage = set(), None
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {
                "status": r.status_code,
                "outcome": classify_status(plan, r.status_code, r.headers, r.json()),
            }
        async for payload in helpers.sse_data(r):
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                error = event["error"]
                continue
            events += 1
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
            usage = event.get("usage") or usage
            if leave and events >= plan.leave_after_events:
                return {"status": 200, "outcome": CLIENT_LEFT}  # closes the connection
    if error is not None:
        replica = error.get("code") == 503 and "replica failed" in error.get("message", "")
        return {"status": 200, "outcome": REPLICA_FAILED if replica else UNEXPECTED, "error": error}
    ok = (
        done
        and len(finished) == plan.n
        and usage is not None
        and usage["completion_tokens"] == plan.n * plan.max_tokens
    )
    if leave and ok:  # it ended before we got to leave: a normal completion
        return {"status": 200, "outcome": COMPLETED}
    if ok:
        return {"status": 200, "outcome": COMPLETED}
    # what was wrong: no [DONE], a choice without its finish, or tokens other than asked for
    got = usage["completion_tokens"] if usage is not None else None
    return {"status": 200, "outcome": UNEXPECTED, "done": done, "finished": len(finished),
            "completion_tokens": got, "expected_tokens": plan.n * plan.max_tokens}  # fmt: skip


async def soak(url: str, args) -> tuple[list[dict], dict]:
    rng = random.Random(args.seed)
    plans = [Plan(i, rng) for i in range(args.requests)]
    kill_at = int(args.kill_at * args.requests)
    limit = asyncio.Semaphore(args.concurrency)
    results: list[dict] = []
    kill: dict = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:

        async def guarded(plan: Plan) -> None:
            async with limit:
                task = asyncio.ensure_future(run_one(client, url, plan))
                if plan.kind == "abort":
                    await asyncio.wait({task}, timeout=plan.abort_after_s)
                    if not task.done():
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                        results.append(
                            {"index": plan.index, "kind": plan.kind, "outcome": CLIENT_LEFT}
                        )
                        return
                results.append(await task)

        async def killer() -> None:
            while len(results) < kill_at:
                await asyncio.sleep(0.05)
            if args.nodes is None:
                kill.update(await asyncio.to_thread(kill_busiest_replica))
            else:
                kill.update(
                    await asyncio.to_thread(
                        lose_busiest_node, args.nodes, args.replicas, args.rejoin_after_s
                    )
                )

        await asyncio.gather(killer(), *(guarded(plan) for plan in plans))
    return results, kill


replica_stats = functools.partial(helpers.replica_stats, APP, max_calls=60)


def kill_busiest_replica() -> dict:
    import ray

    stats = replica_stats(2)
    victim = max(stats.values(), key=lambda s: s["running"] + s["waiting"])
    name = helpers.replica_actor_names(APP).get(victim["replica_id"])
    if name is None:
        raise RuntimeError(f"no actor for replica {victim['replica_id']}")
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return {
        "replica_id": victim["replica_id"],
        "running": victim["running"],
        "waiting": victim["waiting"],
        "at": time.time(),
    }


def lose_busiest_node(nodes, replicas: int, rejoin_after_s: float) -> dict:
    """Kill the worker node of the busiest replica (every process on it, as a machine lost),
    start a fresh worker node `rejoin_after_s` later, and time the way back to `replicas`
    RUNNING replicas (full capacity) from the kill."""
    stats = replica_stats(replicas)
    victim = max(stats.values(), key=lambda s: s["running"] + s["waiting"])
    killed_at = time.monotonic()
    nodes.kill(victim["node_id"])
    time.sleep(rejoin_after_s)
    joined_at = time.monotonic()
    nodes.add_worker()
    helpers.wait_llm_replicas_running(APP, replicas, timeout_s=300 - (joined_at - killed_at))
    back_at = time.monotonic()
    return {
        "replica_id": victim["replica_id"],
        "node_id": victim["node_id"],
        "running": victim["running"],
        "waiting": victim["waiting"],
        "at": time.time(),
        "node_rejoined_after_s": round(joined_at - killed_at, 1),
        "full_capacity_after_s": round(back_at - killed_at, 1),
        "replacement_start_s": round(back_at - joined_at, 1),
    }


def ingress_tally() -> dict:
    """The ingress's migrations (by reason) and calls sent again before their first output."""
    from ray import serve

    stats = serve.get_deployment_handle("Ingress", app_name=APP).stats.remote().result(timeout_s=30)
    return {
        "migrations": stats["migrations"],
        "migration_gaps": stats.get("migration_gaps"),
        "replica_retries": stats["replica_retries"],
    }


def wait_recovered(replicas: int, timeout_s: float) -> tuple[float, dict[str, dict], int]:
    """Wait for `replicas` RUNNING replicas, each idle with every KV block free, and an idle
    ingress. Returns (seconds waited, final replica stats, ingress in-flight count)."""
    from ray import serve

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    ingress = serve.get_deployment_handle("Ingress", app_name=APP)
    while True:
        states = helpers.llm_replica_states(APP)
        stats = replica_stats(replicas) if states == {"RUNNING": replicas} else {}
        inflight = ingress.stats.remote().result(timeout_s=30)["inflight"]
        idle = len(stats) == replicas and all(not leaks_of(s) for s in stats.values())
        if (idle and inflight == 0) or time.monotonic() > deadline:
            return time.monotonic() - t0, stats, inflight
        time.sleep(1.0)


def leaks_of(stats: dict) -> list[str]:
    leaks = []
    if stats["num_free_blocks"] != stats["num_kv_blocks"]:
        leaks.append(f"{stats['num_kv_blocks'] - stats['num_free_blocks']} KV blocks held")
    for key in ("num_unfinished", "waiting", "running", "num_request_states"):
        if stats.get(key, 0):
            leaks.append(f"{key}={stats[key]}")
    return leaks


def deploy_on(config: ClusterConfig, port: int) -> str:
    """Deploy on the running (multi-node) Serve at `port`, under /APP; returns its base URL."""
    from ray import serve

    from cluster.app import build_app

    http = config.http.model_copy(update={"port": port})
    config = config.model_copy(update={"name": APP, "http": http})
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    return f"http://127.0.0.1:{port}/{APP}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="tiny, default or a model directory")
    parser.add_argument("--kill-at", type=float, default=0.4, help="fraction of requests sent")
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--multinode",
        action="store_true",
        help="a Ray cluster of a head and one worker node per replica on this machine; the "
        "busiest replica's whole node is killed and a fresh node joins --rejoin-after-s later",
    )
    parser.add_argument("--rejoin-after-s", type=float, default=15.0)
    parser.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="http.migration_limit: moves of a stream whose replica was lost (0: none, the "
        "killed replica's streams end 'replica failed')",
    )
    args = parser.parse_args()
    args.out = args.out or (RESULTS.with_name("soak_multinode.json") if args.multinode else RESULTS)
    args.nodes = None

    model = model_dir(args.model)
    config = ClusterConfig.model_validate(
        {
            "engine": engine_fields(model),
            "replicas": args.replicas,
            "num_cpus_per_replica": 0.5,
            "http": {
                "host": "127.0.0.1",
                "max_pending_requests": 64,
                "migration_limit": args.migration_limit,
            },
            "auth": {"api_keys": [API_KEY]},
            "routing": {"stats_period_s": 0.5},
        }
    )
    with contextlib.ExitStack() as stack:
        if args.multinode:
            # one CPU per replica, one CPU per worker: a replica lost with its node waits for
            # a node to join (the recovery time is the node's return plus the replica's start)
            config = config.model_copy(update={"num_cpus_per_replica": 1.0})
            port = helpers.free_port()
            args.nodes = stack.enter_context(
                helpers.multinode_serve(port, workers=args.replicas, worker_cpus=1.0)
            )
            url = deploy_on(config, port)
        else:
            cluster = LocalCluster()
            stack.callback(cluster.shutdown)
            url = cluster.deploy(config, APP)
        t0 = time.monotonic()
        results, kill = asyncio.run(soak(url, args))
        duration = time.monotonic() - t0
        recovery_s, final_stats, ingress_inflight = wait_recovered(args.replicas, timeout_s=180)
        tally = ingress_tally()

    outcomes = Counter(r["outcome"] for r in results)
    by_kind = {
        kind: dict(Counter(r["outcome"] for r in results if r["kind"] == kind))
        for kind in sorted({r["kind"] for r in results})
    }
    latencies = sorted(r["latency_s"] for r in results if r["outcome"] == COMPLETED)
    leaks = {rid: leaks_of(s) for rid, s in final_stats.items() if leaks_of(s)}
    unexpected = [r for r in results if r["outcome"] == UNEXPECTED]
    summary = {
        "requests": args.requests,
        "accounted": len(results) - len(unexpected),
        "outcomes": dict(outcomes),
        "by_kind": by_kind,
        "unexpected_examples": unexpected[:10],
        "killed_replica": kill,
        # what the kill cost clients: requests that ended "replica failed" (0 with migration),
        # streams moved to the survivor, calls sent again before their first output
        "replica_failed": outcomes.get(REPLICA_FAILED, 0),
        "migrations": tally["migrations"],
        # each migration's gap in its client's stream: the new replica's prefill of prompt +
        # tokens sent, and its wait for a seat
        "migration_gaps": tally["migration_gaps"],
        "replica_retries": tally["replica_retries"],
        "recovery_s": round(recovery_s, 1),
        "replicas_at_end": len(final_stats),
        "kv_blocks_free_at_end": {
            rid: f"{s['num_free_blocks']}/{s['num_kv_blocks']}" for rid, s in final_stats.items()
        },
        "leaks": leaks,
        "ingress_inflight_at_end": ingress_inflight,
        "preemptions_on_replicas_alive_at_end": sum(
            s["num_preemptions_total"] for s in final_stats.values()
        ),
        "duration_s": round(duration, 1),
        "requests_per_s": round(len(results) / duration, 1),
        "completed_latency_s": {
            "p50": round(statistics.median(latencies), 3) if latencies else None,
            "p99": round(latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else None,
        },
        "config": {
            "concurrency": args.concurrency,
            "replicas": args.replicas,
            "multinode": args.multinode,
            "rejoin_after_s": args.rejoin_after_s if args.multinode else None,
            "migration_limit": args.migration_limit,
            "model": args.model,
            "seed": args.seed,
            "engine": engine_fields(Path(args.model)) | {"model": args.model},
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    ok = (
        len(results) == args.requests
        and not unexpected
        and not leaks
        and len(final_stats) == args.replicas
        and ingress_inflight == 0
        and bool(kill)
        and (args.migration_limit == 0 or not outcomes.get(REPLICA_FAILED))
    )
    summary["pass"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(f"soak {'PASSED' if ok else 'FAILED'}: wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
