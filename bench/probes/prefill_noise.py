"""A prefill step under synthetic wake-ups, with the engine's OpenMP team set up several ways.

`idle_noise.py` measures what a real idle server costs an engine step on the same two cores.
This asks the next question without the server: does any setting of the forward's own threads
make a step pay less for the same wake-ups? The server's idle wake-ups (~2200/s, ~14% of one
core on the AVX-512 host, idle_noise's census) are stood in for by `--noise RATE:BURST_US,...`
processes (a small C loop: sleep 1/RATE s, then spin BURST_US microseconds), so every variant
meets the same noise; `--noise-sched idle` runs them at SCHED_IDLE (what the step would pay if
the stack's wake-ups never preempted it).

Each variant (`--variant NAME=VAR=VALUE,...`) runs in a fresh process (OpenMP reads its
environment once): this script's own engine (`LLM()`, the default model) prefills `--requests`
prompts of `--prompt-len` random tokens one at a time, every other one with the noise stopped
(SIGSTOP). The cost is the median of the paired differences (noisy minus the quiet one before
it). Three settings are not environment variables: `STEPSERVE_PROBE_THREADS=N` (torch threads
after the engine is built), `STEPSERVE_PROBE_PIN=1` (thread i pinned to CPU i, what the
served engine core does with `cpu_pin_threads`) and `STEPSERVE_PROBE_NICE=N` (every thread of
the probe at nice N, the noise staying at 0; below 0 needs CAP_SYS_NICE). Variants run in
rotation for `--rounds`.

Run: .venv/bin/python bench/probes/prefill_noise.py --rounds 2 \
        --variant pinned=STEPSERVE_PROBE_PIN=1 --variant floating= \
        --variant passive=OMP_WAIT_POLICY=passive \
        --variant four=OMP_NUM_THREADS=4,STEPSERVE_PROBE_THREADS=4
Writes bench/results/prefill_noise.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.probes.idle_noise import parse_variant  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
NOISE_C = r"""
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    double rate = atof(argv[1]), burst = atof(argv[2]) * 1e-6;
    struct timespec gap = {0, (long)(1e9 / rate)};
    volatile double x = 0;
    for (;;) { nanosleep(&gap, 0); double t0 = now(); while (now() - t0 < burst) x += 1; }
}
"""


def build_noise(directory: Path) -> Path:
    from replica.layers.cpu_kernels import _compiler

    compiler = _compiler()
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc, or $CC) to build the noise loop")
    source, binary = directory / "noise.c", directory / "noise"
    source.write_text(NOISE_C)
    subprocess.run([compiler, "-O2", "-o", str(binary), str(source)], check=True)
    return binary


def nice_zero() -> None:
    """In a noise process before it runs: back to nice 0 (from a negative STEPSERVE_PROBE_NICE;
    from a positive one only with CAP_SYS_NICE, else it stays at the probe's)."""
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def probe(args) -> dict:
    """One variant, in this process (its environment already set by the parent)."""
    import torch

    from bench.probes.idle_noise import EngineProbe

    engine = EngineProbe(args.prompt_len, seed=args.seed)
    if os.environ.get("STEPSERVE_PROBE_THREADS"):
        torch.set_num_threads(int(os.environ["STEPSERVE_PROBE_THREADS"]))
    pinned = None
    if os.environ.get("STEPSERVE_PROBE_PIN"):
        from replica.layers.cpu_kernels import set_thread_cpus

        pinned = set_thread_cpus(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), True)
    if os.environ.get("STEPSERVE_PROBE_NICE"):
        for tid in os.listdir("/proc/self/task"):  # setpriority is per thread on Linux
            os.setpriority(os.PRIO_PROCESS, int(tid), int(os.environ["STEPSERVE_PROBE_NICE"]))
    engine.run(3, 0.05)  # warm-up
    chrt = ["chrt", "-i", "0"] if args.noise_sched == "idle" else []  # SCHED_IDLE noise
    noise = [
        # at nice 0 whatever this process's threads were set to (a child inherits its nice)
        subprocess.Popen([*chrt, args.noise_binary, *spec.split(":")], preexec_fn=nice_zero)
        for spec in args.noise
    ]
    quiet, noisy = [], []
    try:
        for _ in range(args.requests // 2):
            for p in noise:
                os.kill(p.pid, signal.SIGSTOP)
            quiet += engine.run(1, args.gap)
            for p in noise:
                os.kill(p.pid, signal.SIGCONT)
            noisy += engine.run(1, args.gap)
    finally:
        for p in noise:
            p.kill()
    return {
        "threads": torch.get_num_threads(), "pinned_threads": pinned,
        "quiet_ms_median": round(statistics.median(quiet), 2),
        "noisy_ms_median": round(statistics.median(noisy), 2),
        "paired_cost_ms_median": round(statistics.median(b - a for a, b in zip(quiet, noisy)), 2),
        "quiet_ms": quiet, "noisy_ms": noisy,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=VAR=VALUE,...")
    ap.add_argument("--noise", default="1100:60,1100:60", type=lambda s: s.split(","),
                    help="RATE_HZ:BURST_US per noise process, comma-separated")  # fmt: skip
    ap.add_argument("--noise-sched", choices=("other", "idle"), default="other",
                    help="the noise processes' scheduling policy (idle: SCHED_IDLE)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=24, help="per variant and round")
    ap.add_argument("--prompt-len", type=int, default=75)
    ap.add_argument("--gap", type=float, default=0.15, help="seconds between prefills")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="prefill_noise")
    ap.add_argument("--noise-binary", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args)))
        return
    variants = [parse_variant(v) for v in args.variant or ["default="]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_noise(Path(tmp))
        for round_ in range(args.rounds):
            for name, env in variants:
                cmd = [sys.executable, __file__, "--probe", "--noise-binary", str(binary),
                       "--noise", ",".join(args.noise), "--noise-sched", args.noise_sched,
                       "--requests", str(args.requests),
                       "--prompt-len", str(args.prompt_len), "--gap", str(args.gap),
                       "--seed", str(args.seed + round_)]  # fmt: skip
                out = subprocess.run(cmd, env=dict(os.environ) | env, capture_output=True,
                                     text=True, check=True)  # fmt: skip
                row = {"variant": name, "round": round_, "env": env,
                       **json.loads(out.stdout.strip().splitlines()[-1])}  # fmt: skip
                rows.append(row)
                print(f"{name:12s} round {round_}: quiet {row['quiet_ms_median']:7.1f} ms  "
                      f"noisy {row['noisy_ms_median']:7.1f} ms  paired cost "
                      f"{row['paired_cost_ms_median']:+6.1f} ms  ({row['threads']} threads)",
                      flush=True)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps({"args": vars(args) | {"noise_binary": None}, "rows": rows},
                               indent=1))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
