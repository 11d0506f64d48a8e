"""The same benchmark from two checkouts of this repository (before / after a change), side by
side in one run: rounds alternate which checkout goes first, each round runs the bench once in
each, and the report gives each metric's per-round values, medians and the after/before ratio.
For a redesign that must not move performance: same machine, same minutes, same interpreter.

Run (the "before" checkout as a git worktree):
  git worktree add /tmp/before <commit>
  .venv/bin/python bench/probes/ab_commits.py --before /tmp/before --rounds 3 --out R.json -- \\
      offline_throughput --systems ours:float32 --num-requests 64
  .venv/bin/python bench/probes/ab_commits.py --before /tmp/before --rounds 2 --out R.json -- \\
      http_overhead --num-requests 120

Supported benches and the metrics taken from their JSON: offline_throughput (output tokens/s
per system), http_overhead (every median and p99 of every mode: engine, handle, HTTP, floor,
added), scheduler_overhead (median and p90 per running count and prefix caching),
engine_core_ipc (per batch: the core's encode+send, the front's receive+decode, the bytes). A bench NAME is bench/NAME.py in each checkout, or bench/probes/NAME.py where it has
moved there.
Each checkout's bench runs with that checkout first on sys.path (its own replica/, router/...),
in this interpreter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _flatten(prefix: str, node, out: dict[str, float]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), value, out)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        out[prefix] = float(node)


def metrics(bench: str, report: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    if bench == "offline_throughput":
        _flatten("tok/s", report["output_tokens_per_s"], out)
    elif bench == "scheduler_overhead":
        for row in report["results"]:
            key = f"{row['num_running']}/prefix_{'on' if row['prefix_caching'] else 'off'}"
            out[f"{key}.median_us"] = float(row["median_us"])
            out[f"{key}.p90_us"] = float(row["p90_us"])
    elif bench == "engine_core_ipc":
        for row in report["rows"]:
            for name in ("core_encode_send_us", "front_recv_decode_us", "bytes"):
                out[f"batch_{row['batch']}.{name}"] = float(row[name])
    elif bench == "http_overhead":
        _flatten("", report["modes"], out)  # mode.quantity_ms.{mean,median,p90,p99}
        out = {k: v for k, v in out.items() if k.endswith((".median", ".p99"))}
    else:
        _flatten("", report, out)
    return out


def bench_script(checkout: Path, bench: str) -> Path:
    """The bench in that checkout: bench/NAME.py, or bench/probes/NAME.py where it has moved."""
    top = checkout / "bench" / f"{bench}.py"
    probe = checkout / "bench" / "probes" / f"{bench}.py"
    return top if top.exists() or not probe.exists() else probe


def run_once(checkout: Path, bench: str, args: list[str], out: Path, timeout: int) -> dict:
    cmd = [sys.executable, str(bench_script(checkout, bench)), *args, "--out", str(out)]
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=str(checkout), capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {checkout}: {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="checkout of the older commit")
    p.add_argument("--after", type=Path, default=ROOT, help="checkout of the newer (this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per bench run")
    p.add_argument("--out", type=Path, required=True, help="JSON report")
    p.add_argument("bench", help="bench script name, e.g. offline_throughput")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    bench_args = [x for x in a.bench_args if x != "--"]
    sides = {"before": a.before.resolve(), "after": a.after.resolve()}
    values: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        for r in range(a.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            print(f"round {r + 1}/{a.rounds}: {' then '.join(order)}", flush=True)
            for side in order:
                report = run_once(
                    sides[side], a.bench, bench_args, Path(tmp) / f"{side}-{r}.json", a.timeout
                )
                for key, value in metrics(a.bench, report).items():
                    values[side].setdefault(key, []).append(value)
    summary = {}
    for key in sorted(set(values["before"]) & set(values["after"])):
        before, after = values["before"][key], values["after"][key]
        mb, ma = statistics.median(before), statistics.median(after)
        summary[key] = {
            "before": before,
            "after": after,
            "median_before": mb,
            "median_after": ma,
            "ratio_after_before": round(ma / mb, 3) if mb else None,
        }
    result = {
        "bench": a.bench,
        "bench_args": bench_args,
        "rounds": a.rounds,
        "checkouts": {side: str(path) for side, path in sides.items()},
        "commits": {
            side: subprocess.run(
                ["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            for side, path in sides.items()
        },
        "metrics": summary,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    width = max((len(k) for k in summary), default=10)
    print(f"{'metric':{width}}  median before  median after  after/before")
    for key, row in summary.items():
        print(
            f"{key:{width}}  {row['median_before']:13.2f}  {row['median_after']:12.2f}  "
            f"{row['ratio_after_before']}"
        )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
