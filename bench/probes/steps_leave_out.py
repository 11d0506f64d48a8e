"""The serving step terms fitted on the served steps of other traces, then each trace simulated
against its own real replays: does a fit on one workload's served steps price another's?

For every trace of `--dirs` (bench/sim_fidelity.py output directories replaying the same trace
files, each with `TRACE.steps.jsonl.gz` and `TRACE.real1/2.jsonl`), and for every directory X
of `--eval`: `sim.steptrace.fit_steps` on the steps of the *other* traces' replays in the
directories other than X (a different workload, a different hour), the profile's four step terms
replaced by that fit, and `stepserve simulate --compare` against X's two replays of the trace.
A last case per trace fits on `--fit-only` directories and compares against every `--eval`
directory's replays pooled.

Run: .venv/bin/python bench/probes/steps_leave_out.py --profile NAME \
        --dirs vnni=bench/results/sim_fidelity_vnni_s54,ids=...,check=... \
        --eval ids,check --fit-only vnni --out /tmp/leave_out       # ~25 min on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sim.profile import Profile  # noqa: E402
from sim.steptrace import fit_steps, read_trace, window_of  # noqa: E402

TERMS = ("corun", "prefill_scale", "step_s", "token_s")
REPORT_ROWS = ("metric", "ttft", "tpot", "e2e", "throughput", "verdict")


def trace_file(d: Path, trace: str) -> Path:
    return next(p for p in (d / f"{trace}.csv", d / f"{trace}.jsonl") if p.exists())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--dirs", required=True, help="NAME=DIR,...")
    p.add_argument("--traces", default="azure-chat-light,azure-docs-60,mooncake-shared-90")
    p.add_argument("--eval", required=True, help="NAMEs whose replays are compared")
    p.add_argument("--fit-only", default="", help="NAMEs fitted on for the pooled case")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dirs = {n: Path(d) for n, d in (item.split("=", 1) for item in args.dirs.split(","))}
    traces = args.traces.split(",")
    profile = Profile.load(args.profile)
    source = profile.as_dict()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = {
        (name, t, k): read_trace(d / f"{t}.steps.jsonl.gz", *window_of(d / f"{t}.real{k}.jsonl"))
        for name, d in dirs.items()
        for t in traces
        for k in (1, 2)
    }
    cases = []
    for t in traces:
        others = [o for o in traces if o != t]
        for x in args.eval.split(","):
            cases.append((t, x, [x], [n for n in dirs if n != x], others))
        if args.fit_only:
            cases.append((t, "pooled", args.eval.split(","), args.fit_only.split(","), others))
    results = {}
    for t, label, evals, fitted, others in cases:
        fit = fit_steps(
            [steps[n, o, k] for n in fitted for o in others for k in (1, 2)], profile.model
        )
        variant = copy.deepcopy(source)
        variant["serving"].update({k: fit[k] for k in TERMS})
        path = out / f"fit-{t}-{label}.json"
        path.write_text(json.dumps(variant))
        first = dirs[evals[0]]
        n = sum(1 for _ in open(first / f"{t}.real1.jsonl")) - 1  # less the meta line
        reals = [str(dirs[x] / f"{t}.real{k}.jsonl") for x in evals for k in (1, 2)]
        report = out / f"cmp-{t}-{label}.json"
        cmd = [
            sys.executable, "-m", "cluster.cli", "simulate", "--profile", str(path),
            "--replicas", "2", "--workload", f"trace:{trace_file(first, t)}",
            "--num-requests", str(n), "--seed", "1", "--compare", *reals,
            "--compare-json", str(report),
        ]  # fmt: skip
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        terms = {k: round(fit[k], 5) for k in TERMS}
        print(f"== {t} vs {label} (fit on {fitted} x {others}: {fit['steps']} steps) {terms}")
        lines = [line for line in run.stdout.splitlines() if line.startswith(REPORT_ROWS)]
        print("\n".join(lines) if lines else run.stdout[-2000:] + run.stderr[-2000:], flush=True)
        results[f"{t}/{label}"] = {"fitted_on": fitted, "terms": terms, "steps": fit["steps"]}
    (out / "fits.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
