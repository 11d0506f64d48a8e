"""The ingress's own CPU per streamed delta, without Ray: one completions stream of N deltas
through `Answers.stream` (fan-out, migration bookkeeping, pacing, SSE rendering) from a fake
replica that yields one delta per event-loop turn. What Ray Serve's per-item stream and the
HTTP send add on top is not in it (serving_path_cpu.py measures the whole path).

Run: .venv/bin/python bench/probes/ingress_stream_cpu.py [--deltas 3000] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "router")]

from test_migration import Replicas, Tokenizer, calls, choice  # noqa: E402

from router.admission import Admission  # noqa: E402
from router.dialects import CompletionDialect  # noqa: E402
from router.protocol import CompletionRequest  # noqa: E402
from router.streaming import Answers, Ticket  # noqa: E402


def one_stream(n: int) -> tuple[float, int]:
    """CPU microseconds per delta of one streamed answer of n deltas, and its SSE writes."""
    answers = Answers(calls(Replicas()), Admission(), keepalive_s=30)
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": n, "stream": True})
    jobs = [(0, choice([3, 9, 9], max_tokens=n))]
    ticket = Ticket(types.SimpleNamespace(release=lambda: None), deadline_s=600)
    answers.admission.enter(ticket.key)
    dialect = CompletionDialect(Tokenizer(), "m")

    async def run() -> int:
        return sum([1 async for _ in answers.stream(jobs, dialect, req, ticket)])

    started = time.process_time()
    writes = asyncio.run(run())
    return (time.process_time() - started) / n * 1e6, writes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deltas", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile one stream, by own time")
    args = p.parse_args()
    runs = [one_stream(args.deltas) for _ in range(args.repeats)]
    per_delta = statistics.median(us for us, _ in runs)
    print(f"ingress CPU per delta: {per_delta:.1f} us (median of {args.repeats}); "
          f"{runs[0][1]} SSE writes for {args.deltas} deltas")  # fmt: skip
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.runcall(one_stream, args.deltas)
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
