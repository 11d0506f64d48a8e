"""Scheduler overhead per step: wall time of schedule() + update_from_output() with N running
decode requests (no model; the fake runner's work is not timed). Prints a table and writes
bench/results/scheduler_overhead.json.

Run: .venv/bin/python bench/scheduler_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replica.config import EngineConfig  # noqa: E402
from replica.request import EngineRequest, Request, SamplingParams  # noqa: E402
from replica.scheduler import Scheduler  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "scheduler_overhead.json"
PROMPT_LEN = 32
BLOCK_SIZE = 16
TARGET_US_AT_256 = 1000.0


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(num_running: int, num_steps: int, prefix_caching: bool, warmup: int = 20) -> dict:
    """Prefill `num_running` requests (untimed), then time `num_steps` pure-decode steps.

    Prompt lengths are staggered over one block, so block boundaries (a new block, a block to
    hash and cache) fall on 1/BLOCK_SIZE of the requests each step, as in a real mix."""
    max_tokens = warmup + num_steps + 2  # nobody finishes while we measure
    prompt_lens = [PROMPT_LEN + i % BLOCK_SIZE for i in range(num_running)]
    blocks_per_request = -(-(max(prompt_lens) + max_tokens) // BLOCK_SIZE)
    config = EngineConfig(
        max_num_seqs=num_running,
        max_num_batched_tokens=sum(prompt_lens),
        block_size=BLOCK_SIZE,
        enable_prefix_caching=prefix_caching,
    )
    sched = Scheduler(config, num_running * blocks_per_request, max_model_len=4096)
    for i, prompt_len in enumerate(prompt_lens):
        tokens = [(i * 64 + j) % 50_000 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens)
        sched.add_request(Request(EngineRequest(tokens, params, f"req-{i}")))

    schedule_ns: list[int] = []
    update_ns: list[int] = []
    gc.collect()
    for step in range(warmup + 1 + num_steps):
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        sampled = {s.request.request_id: 7 for s in out.scheduled}  # the "model": not timed
        t2 = time.perf_counter_ns()
        sched.update_from_output(out, sampled)
        t3 = time.perf_counter_ns()
        if step == 0:
            assert out.total_num_scheduled_tokens == sum(prompt_lens), "prefill not done"
        elif step > warmup:
            assert out.total_num_scheduled_tokens == num_running, "not a pure decode step"
            schedule_ns.append(t1 - t0)
            update_ns.append(t3 - t2)
    assert len(sched.running) == num_running
    totals_us = [(a + b) / 1000 for a, b in zip(schedule_ns, update_ns, strict=True)]
    median = statistics.median(totals_us)
    return {
        "num_running": num_running,
        "prefix_caching": prefix_caching,
        "steps": num_steps,
        "median_us": round(median, 1),
        "p90_us": round(percentile(totals_us, 0.9), 1),
        "median_schedule_us": round(statistics.median(schedule_ns) / 1000, 1),
        "median_update_us": round(statistics.median(update_ns) / 1000, 1),
        "median_ns_per_request": round(median * 1000 / num_running),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON report")
    args = parser.parse_args()
    plan = [(64, 2000), (256, 1000), (1024, 300)]
    if args.quick:
        plan = [(n, max(20, steps // 20)) for n, steps in plan]
    load_before = os.getloadavg()[0]  # the figures are wall time: note how busy the host was
    rows = [
        measure(n, steps, prefix_caching) for prefix_caching in (True, False) for n, steps in plan
    ]

    header = (
        f"{'running':>8} {'prefix$':>8} {'median us':>10} {'p90 us':>9} "
        f"{'schedule':>9} {'update':>9} {'ns/req':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['num_running']:>8} {'on' if r['prefix_caching'] else 'off':>8} "
            f"{r['median_us']:>10.1f} {r['p90_us']:>9.1f} {r['median_schedule_us']:>9.1f} "
            f"{r['median_update_us']:>9.1f} {r['median_ns_per_request']:>7}"
        )
    at_256 = [r["median_us"] for r in rows if r["num_running"] == 256]
    met = all(us < TARGET_US_AT_256 for us in at_256)
    print(
        f"target: median < {TARGET_US_AT_256:.0f} us at 256 running decodes: {'met' if met else 'MISSED'}"
    )

    if args.quick:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "scheduler_overhead",
                "what": "schedule() + update_from_output() wall time per pure-decode step",
                "prompt_len": f"{PROMPT_LEN}..{PROMPT_LEN + BLOCK_SIZE - 1} (staggered)",
                "block_size": BLOCK_SIZE,
                "target": f"median < {TARGET_US_AT_256:.0f} us at 256 running decodes",
                "target_met": met,
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
                "load_average_1m_before": round(load_before, 2),
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
