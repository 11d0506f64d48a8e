"""An idle `stepserve serve`'s CPU and wake-ups by process role (issue 50): the server starts
(`--tree NAME=PATH` checkouts and `--variant NAME=KEY=VALUE,...` environments in rotation for
`--rounds`), answers a short warm-up, settles, then sits idle for `--windows` windows of
`--window-s` seconds; per window and role it reads from /proc the CPU (utime + stime, ms per
second) and the context switches (voluntary + involuntary of every thread, per second: a
wake-up each, near enough). Prints the medians over windows and starts per variant and role;
writes bench/results/idle_cpu.json. CPU time is fair even on a busy host (it is not wall time).

Run (it starts Ray): flock /tmp/stepserve-ray.lock .venv/bin/python bench/probes/idle_cpu.py \
        --model tiny --tree before=/tmp/before --tree after=. --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._models import model_dir as resolve_model  # noqa: E402
from bench.serving_path_cpu import CLOCK_TICKS, role_of, session_counters  # noqa: E402
from bench.serving_vs_peer import server_command, started_server  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def window(session: int, seconds: float) -> dict[str, dict[str, float]]:
    """role -> {cpu_ms_s, switches_s} over one idle window."""
    t0, before = time.monotonic(), session_counters(session, switches=True)
    time.sleep(seconds)
    after, span = session_counters(session, switches=True), time.monotonic() - t0
    roles: dict[str, dict[str, float]] = {}
    for pid, (ticks, switches, cmd) in after.items():
        t_b, s_b, _ = before.get(pid, (0, 0, cmd))
        role = roles.setdefault(role_of(cmd), {"cpu_ms_s": 0.0, "switches_s": 0.0})
        role["cpu_ms_s"] += 1000 * (ticks - t_b) / CLOCK_TICKS / span
        role["switches_s"] += max(0, switches - s_b) / span
    total = {k: sum(r[k] for n, r in roles.items() if n != "engine core") for k in ("cpu_ms_s",)}
    total["switches_s"] = sum(r["switches_s"] for n, r in roles.items() if n != "engine core")
    roles["TOTAL but engine core"] = total
    return roles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH (default: this one)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=KEY=VALUE,... environment for every tree's server (repeatable; 'NAME=' none)",
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--settle-s", type=float, default=10.0)
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.add_argument("--stepserve-args", default="")
    p.add_argument("--port", type=int, default=8032)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="idle_cpu")
    args = p.parse_args()
    args.tree = args.tree or [f"this={Path(__file__).resolve().parents[2]}"]
    args.dataset = "random"
    variants = {}
    for spec in args.variant or ["default="]:
        name, _, settings = spec.partition("=")
        variants[name] = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    model = resolve_model(args.model)
    combos = [(t.split("=", 1)[0], v) for t in args.tree for v in variants]
    runs: dict[str, list] = {f"{t}/{v}": [] for t, v in combos}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for tree, var in combos[r % len(combos) :] + combos[: r % len(combos)]:
                label, system = f"{tree}/{var}", f"stepserve+haproxy@{tree}"
                argv, env = server_command(system, args, model, args.port)
                env |= variants[var]
                print(f"== round {r + 1}: {label}", flush=True)
                procs: list = []
                log = Path(tmp) / f"{tree}-{var}-{r}.log"
                with started_server(system, argv, env, args, log, procs):
                    session = os.getsid(procs[0].pid)
                    for _ in range(args.windows):
                        w = window(session, args.window_s)
                        runs[label].append(w)
                        print(f"   {label}: {json.dumps(w['TOTAL but engine core'])}", flush=True)
                time.sleep(3)
    summary = {}
    for label, ws in runs.items():
        roles = sorted({r for w in ws for r in w})
        summary[label] = {
            r: {
                k: round(statistics.median(w.get(r, {}).get(k, 0.0) for w in ws), 1)
                for k in ("cpu_ms_s", "switches_s")
            }
            for r in roles
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps({"args": vars(args), "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {path}\nmedian idle CPU ms/s | context switches/s, by role")
    roles = sorted({r for s in summary.values() for r in s})
    print(f"{'role':<24}" + "".join(f"{label:>22}" for label in summary))
    for role in roles:
        cells = "".join(
            f"{s.get(role, {}).get('cpu_ms_s', 0):>12.1f} |{s.get(role, {}).get('switches_s', 0):>7.0f}"
            for s in summary.values()
        )
        print(f"{role:<24}{cells}")


if __name__ == "__main__":
    main()
