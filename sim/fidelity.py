"""The fidelity report: a trace replayed on a real cluster (one or more runs, in the replay
record format below) against the same trace simulated, per metric, with the real runs' own
spread, and pass/fail against the bar (`stepserve simulate --compare`).

Replay record (JSONL; bench/trace_replay.py writes it, `read_run` reads it): the first line
describes the run, every other line one request of the trace, in trace order:

    {"type": "run", "trace": PATH, "seed": S, "time_scale": X, "requests": N, "base_url": URL,
     "started_at": UNIX_S, "load_average_1m": L, "queue_time_s_sum": Q, "queue_time_count": C,
     "prefix_cache_queries": PQ, "prefix_cache_hits": PH, "engine_steps": S,
     "engine_step_s_sum": SS, "preemptions": P}
    {"type": "request", "index": I, "arrival_s": T, "start_s": T', "prompt_tokens": P,
     "output_tokens": O, "expected_output_tokens": O', "success": true, "ttft_s": ...,
     "tpot_s": ... or null, "e2e_s": ..., "error": ""}

`arrival_s` is the trace's time (after `time_scale`), `start_s` when the request was sent (s
from the run's start); TPOT is (e2e - TTFT) / (output tokens - 1). The queue-time fields (the
servers' `vllm:request_queue_time_seconds` over the run) and the other server totals (prefix
cache, engine steps, preemptions: deltas of the replicas' metrics over the run) are optional.

The bar: every p50 (and the throughput) within 10% of the real runs' median, every p99 within
20%, or within the real runs' own spread ((max - min) / median over the runs) where that is
larger. The server-side figures are shown, not judged: the mean queue time (the client cannot see it per
request), the prefix cache's hit rate (hit / queried prompt tokens), the engine steps and their
mean time (the simulator's: its served steps)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from sim.results import percentiles

LATENCIES = ("ttft", "tpot", "e2e")
# metric -> the bar its error must meet (relative to the real median)
BAR = {
    "ttft_p50": 0.10,
    "ttft_p99": 0.20,
    "tpot_p50": 0.10,
    "tpot_p99": 0.20,
    "e2e_p50": 0.10,
    "e2e_p99": 0.20,
    "throughput": 0.10,
}
SHOWN = ("queue_mean", "hit_rate", "steps", "step_mean")  # reported, not judged


@dataclass
class RealRun:
    """One replay of a trace on a real cluster: its description line and its request rows."""

    meta: dict
    rows: list[dict]
    path: str = ""


def write_run(path: str | Path, meta: dict, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"type": "run", **meta}) + "\n")
        for row in rows:
            f.write(json.dumps({"type": "request", **row}) + "\n")


def read_run(path: str | Path) -> RealRun:
    """A replay record (see the module docstring); ValueError naming the line if it is not one."""
    meta: dict = {}
    rows: list[dict] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from exc
            kind = row.pop("type", None)
            if kind == "run":
                meta = row
            elif kind == "request":
                missing = [
                    k for k in ("ttft_s", "e2e_s", "output_tokens", "success") if k not in row
                ]
                if missing:
                    raise ValueError(f"{path}:{line_no}: request row lacks {', '.join(missing)}")
                rows.append(row)
            else:
                raise ValueError(
                    f"{path}:{line_no}: type {kind!r}: expected 'run' or 'request' (a replay "
                    "record written by bench/trace_replay.py)"
                )
    if not rows:
        raise ValueError(f"{path}: no request rows")
    return RealRun(meta, rows, str(path))


def check_matches(run: RealRun, prompt_lengths: list[int]) -> None:
    """Refuse a record that is not a replay of this trace (count or prompt lengths differ)."""
    if len(run.rows) != len(prompt_lengths):
        raise ValueError(
            f"{run.path}: {len(run.rows)} requests, the trace has {len(prompt_lengths)} "
            "(use the same --num-requests the replay used)"
        )
    for i, (row, n) in enumerate(zip(run.rows, prompt_lengths)):
        if row.get("prompt_tokens", n) != n:
            raise ValueError(
                f"{run.path}: request {i} has {row['prompt_tokens']} prompt tokens, the trace's "
                f"has {n}: not a replay of this trace"
            )


def metrics(rows: list[dict]) -> dict:
    """p50/p90/p99 of TTFT, TPOT and e2e (s), output tokens/s from the first send to the last
    finish, over the successful rows (each: success, start_s, ttft_s, tpot_s, e2e_s,
    output_tokens); plus the request counts."""
    ok = [r for r in rows if r["success"]]
    out: dict = {"completed": len(ok), "failed": len(rows) - len(ok)}
    for name in LATENCIES:
        vals = sorted(v for r in ok if (v := r.get(f"{name}_s")) is not None and v == v)
        for q, v in percentiles(vals).items():
            if q != "mean":
                out[f"{name}_{q}"] = v
    if ok:
        span = max(r["start_s"] + r["e2e_s"] for r in ok) - min(r["start_s"] for r in ok)
        out["throughput"] = sum(r["output_tokens"] for r in ok) / span if span > 0 else math.nan
    return out


def _server(out: dict, queries: float, hits: float, steps: float, step_s: float) -> None:
    if queries:
        out["hit_rate"] = hits / queries
    if steps:
        out["steps"] = steps
        out["step_mean"] = step_s / steps


def real_metrics(run: RealRun) -> dict:
    out = metrics(run.rows)
    meta = run.meta
    count = meta.get("queue_time_count")
    if count:
        out["queue_mean"] = meta["queue_time_s_sum"] / count
    _server(
        out, meta.get("prefix_cache_queries", 0), meta.get("prefix_cache_hits", 0),
        meta.get("engine_steps", 0), meta.get("engine_step_s_sum", 0.0),
    )  # fmt: skip
    return out


def sim_metrics(requests: list[dict], replicas: list[dict] | None = None) -> dict:
    """`metrics` of a simulation's per-request results (SimResult.requests), with the server
    totals of its replicas (SimResult.replicas) where given."""
    rows = [
        {
            "success": r["status"] == "ok",
            "start_s": r["arrival_s"],
            "ttft_s": r["ttft_s"],
            "tpot_s": r["tpot_s"],
            "e2e_s": r["e2e_s"],
            "output_tokens": r["output_tokens"],
        }
        for r in requests
    ]
    out = metrics(rows)
    queued = [
        r["queue_s"] for r in requests if r["status"] == "ok" and r["queue_s"] == r["queue_s"]
    ]
    if queued:
        out["queue_mean"] = sum(queued) / len(queued)
    if replicas:
        _server(
            out, sum(r["prefix_cache_queries"] for r in replicas),
            sum(r["prefix_cache_hits"] for r in replicas), sum(r["steps"] for r in replicas),
            sum(r["busy_s"] for r in replicas),
        )  # fmt: skip
    return out


def median_metrics(sims: list[dict]) -> dict:
    """Per metric, the median over several simulations (seeds) of one trace; `failed` is the
    most any of them left unfinished."""
    if not sims:
        raise ValueError("no simulations to combine")
    out: dict = {}
    for key in {k for s in sims for k in s}:
        values = [s[key] for s in sims if key in s and s[key] == s[key]]
        if key == "failed":
            out[key] = max(values)
        elif values:
            out[key] = statistics.median(values)
    return out


def compare(real: list[dict], sim: dict, sim_runs: list[dict] | None = None) -> dict:
    """Per metric: the real runs' values, median, spread between them ((max - min) / median),
    each run against the median, the simulation's value and error against the median, the
    tolerance (the bar, or the spread where larger) and whether it is met. `ok`: every judged
    metric met, no real request failed and the simulation completed every request. With
    `sim_runs` (the simulations `sim` is the median of: one per seed) each row also shows their
    spread, which the verdict does not widen."""
    if not real:
        raise ValueError("no real runs to compare with")
    rows = {}
    for key in (*BAR, *SHOWN):
        values = [r.get(key) for r in real]
        if any(v is None or v != v for v in values):
            continue
        median = statistics.median(values)
        simulated = sim.get(key, math.nan)
        row = {
            "real": values,
            "median": median,
            "spread": (max(values) - min(values)) / median if median > 0 else math.nan,
            "runs_vs_median": [v / median - 1 if median > 0 else math.nan for v in values],
            "sim": simulated,
            "error": simulated / median - 1 if median > 0 else math.nan,
        }
        if sim_runs and len(sim_runs) > 1:
            each = [x.get(key, math.nan) for x in sim_runs]
            row["sim_runs"] = each
            row["sim_spread"] = (max(each) - min(each)) / simulated if simulated > 0 else math.nan
        if key in BAR:
            row["bar"] = BAR[key]
            row["tolerance"] = (
                max(BAR[key], row["spread"]) if row["spread"] == row["spread"] else BAR[key]
            )
            row["ok"] = bool(abs(row["error"]) <= row["tolerance"])  # nan fails
        rows[key] = row
    failed = sum(r["failed"] for r in real)
    not_done = sim.get("failed", 0)
    ok = all(r["ok"] for r in rows.values() if "ok" in r) and not failed and not not_done
    return {
        "metrics": rows,
        "real_failed": failed,
        "sim_not_completed": not_done,
        "ok": ok,
    }


def _ms(key: str, v: float) -> str:
    if v != v:
        return "n/a"
    if key == "hit_rate":
        return f"{v:.3f}"
    if key == "steps":
        return f"{v:.0f}"
    return f"{v:.1f}" if key == "throughput" else f"{v * 1e3:.1f}"


def format_report(report: dict, names: list[str] | None = None) -> str:
    """The comparison as a table: real runs, their median and spread, the simulation, its
    error, the tolerance and the verdict per metric."""
    rows = report["metrics"]
    n = len(next(iter(rows.values()))["real"]) if rows else 0
    names = names or [f"run{i + 1}" for i in range(n)]
    head = (
        f"{'metric':12s} " + " ".join(f"{x[-10:]:>10s}" for x in names)
        + f" {'median':>10s} {'spread':>7s} {'runs-med':>13s} {'sim':>10s} {'error':>8s} "
        f"{'tol':>5s}  verdict"
    )  # fmt: skip
    seeds = any("sim_spread" in r for r in rows.values())
    if seeds:
        head = head.replace(f" {'error':>8s}", f" {'sim-spr':>7s} {'error':>8s}")
    lines = [head]
    for key, r in rows.items():
        unit = " tok/s" if key == "throughput" else ""
        runs = " ".join(f"{_ms(key, v):>10s}" for v in r["real"])
        each = "/".join(f"{x:+.1%}" for x in r["runs_vs_median"])
        verdict = ("pass" if r["ok"] else "FAIL") if "ok" in r else "(shown)"
        tol = f"{r['tolerance']:.0%}" if "tolerance" in r else ""
        lines.append(
            f"{key:12s} {runs} {_ms(key, r['median']):>10s} {r['spread']:7.1%} {each:>13s} "
            f"{_ms(key, r['sim']):>10s}"
            + (f" {r.get('sim_spread', math.nan):7.1%}" if seeds else "")
            + f" {r['error']:+8.1%} {tol:>5s}  {verdict}{unit}"
        )
    lines.append(
        "latencies in ms; spread: (max - min) / median of the real runs; error: sim / median - 1; "
        "tol: the bar (p50 10%, p99 20%) or the spread where larger"
        + (f"; sim: the median of {len(report['sim_seeds'])} seeds, sim-spr their spread"
           if seeds and report.get("sim_seeds") else "")
    )  # fmt: skip
    if report["real_failed"]:
        lines.append(f"FAIL: {report['real_failed']} real requests failed")
    if report["sim_not_completed"]:
        lines.append(f"FAIL: {report['sim_not_completed']} simulated requests not completed")
    lines.append("verdict: " + ("PASS" if report["ok"] else "FAIL"))
    return "\n".join(lines)
