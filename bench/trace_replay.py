"""Replay a trace file (Azure CSV or Mooncake JSONL: sim/workloads.py) on a running stepserve
server with the trace's own timing, prompt lengths and (Mooncake) shared prefixes, streaming
each request from /v1/completions as token ids; write the replay record `stepserve simulate
--compare` reads (sim/fidelity.py), with the servers' totals over the run from /metrics (queue
time, prefix cache queries and hits, engine steps and their time, preemptions).

`--seed` draws the prompts' token ids (the same lengths, times and sharing for any seed): give
each replay of one server its own, so a second replay does not hit the first one's prefix cache.

Run: .venv/bin/python bench/trace_replay.py --base-url http://127.0.0.1:8000 \
        --trace sim/traces/azure_sample.csv --seed 1 --out /tmp/real1.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import LoadConfig, run_load  # noqa: E402
from sim.fidelity import RealRun, write_run  # noqa: E402
from sim.host import CpuTimes, host_load  # noqa: E402
from sim.workloads import read_trace  # noqa: E402

QUEUE = "vllm:request_queue_time_seconds"
# the replay record's server-side totals (deltas over the run, every replica's label sets
# summed): field -> metric (a counter's `_total` sample counts as its name)
SERVER_TOTALS = {
    "queue_time_s_sum": QUEUE + "_sum",
    "queue_time_count": QUEUE + "_count",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "engine_step_s_sum": "stepserve:engine_step_duration_seconds_sum",
    "engine_steps": "stepserve:engine_step_duration_seconds_count",
    "preemptions": "vllm:num_preemptions",
}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(?P<value>\S+)")


def server_totals(exposition: str) -> dict[str, float]:
    """SERVER_TOTALS' fields summed over every label set of a Prometheus text."""
    field = {metric: key for key, metric in SERVER_TOTALS.items()}
    out = dict.fromkeys(SERVER_TOTALS, 0.0)
    for line in exposition.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m["name"].removesuffix("_total")
        if name in field:
            out[field[name]] += float(m["value"])
    return out


def queue_totals(exposition: str) -> tuple[float, float]:
    """(sum, count) of the queue-time histogram over every label set of a Prometheus text."""
    totals = server_totals(exposition)
    return totals["queue_time_s_sum"], totals["queue_time_count"]


def scrape_totals(base_url: str) -> dict[str, float] | None:
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return server_totals(resp.text)


def replay(
    base_url: str,
    trace: str | Path,
    out: str | Path,
    seed: int = 0,
    limit: int | None = None,
    time_scale: float = 1.0,
    settle_s: float = 2.5,
    max_concurrency: int | None = None,
) -> RealRun:
    """Send the trace, write its replay record to `out`, and return it (`max_concurrency`:
    at most that many in flight, a closed loop; the trace's timing then only orders them)."""
    rows = read_trace(trace, limit=limit, seed=seed)
    offsets = [r.arrival_s / time_scale for r in rows]
    specs = [r.spec for r in rows]
    before = scrape_totals(base_url)
    cpu_start = CpuTimes.now()
    started = time.time()
    mono = time.monotonic()
    # TTFT at the first token the engine sends, text or not (a random-token prompt's answer
    # often starts with part of a UTF-8 character, whose text waits for the next step)
    load = LoadConfig(
        base_url=base_url, max_concurrency=max_concurrency, extra_body={"return_token_ids": True}
    )
    results, wall = asyncio.run(run_load(load, specs, offsets))
    cpu = host_load(cpu_start, CpuTimes.now())
    time.sleep(settle_s)  # replicas push their metrics about once a second
    after = scrape_totals(base_url)
    meta = {
        "trace": str(trace),
        "seed": seed,
        "time_scale": time_scale,
        "requests": len(rows),
        "base_url": base_url,
        "started_at": started,
        "wall_s": wall,
        # the run on the host's monotonic clock, which a server's step trace uses
        # (STEPSERVE_STEP_TRACE; `stepserve steps TRACE@RECORD` keeps this window's steps)
        "monotonic_start": mono,
        "monotonic_end": time.monotonic(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        # the host's CPU over the run (the server's and this client's work included): a slower
        # run with more stolen time was the host's, not the cluster's
        "host_cpu": {k: cpu[k] for k in ("busy_share", "idle_share", "steal_share")},
    }
    if (
        before is not None
        and after is not None
        and after["queue_time_count"] > before["queue_time_count"]
    ):
        meta.update({key: after[key] - before[key] for key in SERVER_TOTALS})
    records = [
        {
            "index": i,
            "arrival_s": round(offsets[i], 6),
            "start_s": round(r.start, 6),
            "prompt_tokens": r.prompt_len,
            "output_tokens": r.output_len,
            "expected_output_tokens": r.expected_output_len,
            "success": r.success,
            "ttft_s": round(r.ttft, 6),
            "tpot_s": None if r.tpot is None else round(r.tpot, 6),
            "e2e_s": round(r.e2e, 6),
            "error": r.error,
        }
        for i, r in enumerate(results)
    ]
    write_run(out, meta, records)
    return RealRun(meta, records, str(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--trace", required=True, help="Azure .csv or Mooncake .jsonl")
    p.add_argument("--out", required=True, help="the replay record (JSONL) to write")
    p.add_argument("--seed", type=int, default=0, help="draws the prompts' token ids")
    p.add_argument("--num-requests", type=int, help="the trace's first N requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide arrival times")
    args = p.parse_args()
    run = replay(args.base_url, args.trace, args.out, args.seed, args.num_requests, args.time_scale)
    ok = sum(r["success"] for r in run.rows)
    print(f"replayed {len(run.rows)} requests ({ok} ok) in {run.meta['wall_s']:.1f} s: {args.out}")
    return 0 if ok == len(run.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
