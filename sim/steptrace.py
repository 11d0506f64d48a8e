"""Step traces read, summarised and priced: the engine cores' (STEPSERVE_STEP_TRACE, one line per
step: when it ended, how long it took, what it ran) or the simulator's (`stepserve simulate
--step-trace`, the same lines). Per replica: the steps, their time, what they held (prefill
chunks, decode batch), the gaps between back-to-back steps; with a profile, each step's time
against the profile's price for the same shape (Engine.step alone, and the serving fit's price
with its co-running and streaming terms). A real trace and a simulated one side by side tell
whether the simulator misprices steps (real / price off 1) or schedules other steps than the
real replicas ran (other shapes, batch sizes, step counts)."""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.profile import StepShape, group_errors, prefill_part, robust_lstsq, serving_step

# a gap between two steps of a replica that share a request is the engine loop's own time (it
# had work); longer than this it waited for something else (the host, a lock) and is counted
# apart
LOOP_GAP_S = 0.050


@dataclass
class TracedStep:
    replica: str
    end: float
    dur: float
    rows: list  # [request id, first position, tokens, draft tokens, prompt tokens]

    @property
    def start(self) -> float:
        return self.end - self.dur

    def shape(self) -> StepShape:
        """As the simulator prices it (StepShape.of_scheduler_output: a one-token chunk past
        the prompt is a decode)."""
        prefill, decode = [], []
        for _, start, tokens, _, prompt in self.rows:
            if tokens == 1 and start >= prompt:
                decode.append(start + 1)
            else:
                prefill.append((tokens, start))
        return StepShape.of(prefill, decode)

    def streamed(self) -> int:
        """The requests that sample a token in it (a prompt's last chunk or a decode; a
        preempted request's recompute is counted as sampling when it passes its prompt)."""
        return sum(1 for _, start, tokens, drafts, prompt in self.rows
                   if start + tokens - drafts >= prompt)  # fmt: skip

    def prefill_tokens(self) -> int:
        """Prompt tokens run in it (a decode's draft tokens are not: its row starts past the
        prompt)."""
        return sum(t for _, s, t, _, p in self.rows if s < p)

    def decodes(self) -> int:
        """Requests past their prompt in it (a decode with drafts counts as one)."""
        return sum(1 for _, s, _, _, p in self.rows if s >= p)


def follow_gap(a: TracedStep, b: TracedStep) -> float | None:
    """The loop's gap from step `a` to its replica's next step `b` when `b` goes on with a
    request of `a` (the replica had work: the gap is the engine loop's own), else None."""
    if {row[0] for row in a.rows} & {row[0] for row in b.rows}:
        return max(b.start - a.end, 0.0)  # float rounding: back to back is 0
    return None


def _open_text(path: str | Path):
    """A trace file for reading, through gzip when it ends in `.gz`."""
    return (gzip.open if str(path).endswith(".gz") else open)(path, "rt")


def read_trace(
    path: str | Path, since: float | None = None, until: float | None = None
) -> dict[str, list[TracedStep]]:
    """Each replica's steps (by the `pid` its lines carry; a trace without it is one replica),
    in time order, those that started in [since, until] when given (a `.gz` file is read
    through gzip)."""
    out: dict[str, list[TracedStep]] = {}
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line: {exc}") from None
            if d.get("ev") != "step":
                continue
            step = TracedStep(str(d.get("pid", "-")), float(d["t"]), float(d["dur"]), d["reqs"])
            if since is not None and step.start < since:
                continue
            if until is not None and step.start > until:
                continue
            out.setdefault(step.replica, []).append(step)
    for steps in out.values():
        steps.sort(key=lambda s: s.end)
    return out


def window_of(record: str | Path, meta: dict | None = None) -> tuple[float, float]:
    """A replay record's run on the monotonic clock (bench/trace_replay.py's meta: its first
    line, read unless given)."""
    if meta is None:
        with open(record) as f:
            meta = json.loads(f.readline())
    if "monotonic_start" not in meta:
        raise ValueError(f"{record}: no monotonic_start in its first line (an older replay)")
    return meta["monotonic_start"], meta["monotonic_end"]


def corun_shares(trace: dict[str, list[TracedStep]]) -> dict[int, float]:
    """Per step (by id()): the share of its time the host's other replicas spent in steps,
    averaged over them (sim/replica.py's `host_busy`, measured)."""
    out: dict[int, float] = {}
    names = list(trace)
    spans = {
        r: (np.array([s.start for s in trace[r]]), np.array([s.end for s in trace[r]]))
        for r in names
    }
    for r in names:
        others = [o for o in names if o != r]
        for step in trace[r]:
            if not others or step.dur <= 0:
                out[id(step)] = 0.0
                continue
            share = 0.0
            for o in others:
                starts, ends = spans[o]
                lo = np.searchsorted(
                    ends, step.start
                )  # the first of o's steps ending after it starts
                hi = np.searchsorted(starts, step.end)  # past the last starting before it ends
                if hi > lo:
                    a = np.maximum(starts[lo:hi], step.start)
                    b = np.minimum(ends[lo:hi], step.end)
                    share += float(np.clip(b - a, 0, None).sum()) / step.dur
            out[id(step)] = min(share / len(others), 1.0)
    return out


def _q(values, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else float("nan")


def summarise(trace: dict[str, list[TracedStep]], profile=None) -> dict:
    """Per replica and over all: steps, busy seconds, span, loop gaps, step composition, and with
    a profile, real time over its prices (sums and per-step quantiles, split by what the step
    held and whether another replica was in a step)."""
    corun = corun_shares(trace)
    model = profile.model if profile is not None else None
    serving = profile.serving if profile is not None else None
    every = [s for steps in trace.values() for s in steps]
    if model is not None:  # each step's shape and Engine.step price, once ("all" has them too)
        shape = {id(s): s.shape() for s in every}
        price = {k: model.predict(v) for k, v in shape.items()}
    groups = {**{r: steps for r, steps in sorted(trace.items())}}
    if len(trace) > 1:
        groups["all"] = every
    out = {}
    for name, steps in groups.items():
        if not steps:
            continue
        durs = np.array([s.dur for s in steps])
        mixed = np.array([s.prefill_tokens() > 0 for s in steps])
        decodes = np.array([s.decodes() for s in steps])
        gaps, waits = [], []
        reps = [name] if name != "all" else list(trace)
        for r in reps:
            seq = trace[r]
            for a, b in zip(seq, seq[1:]):
                g = follow_gap(a, b)
                if g is not None:
                    (gaps if g <= LOOP_GAP_S else waits).append(g)
        span = max(s.end for s in steps) - min(s.start for s in steps)
        d = {
            "steps": len(steps),
            "busy_s": float(durs.sum()),
            "span_s": span,
            "step_ms_p50": _q(durs, 0.5) * 1e3,
            "step_ms_p99": _q(durs, 0.99) * 1e3,
            "step_ms_mean": float(durs.mean()) * 1e3,
            "mixed_share": float(mixed.mean()),
            "decode_batch_mean": float(decodes.mean()),
            "tokens_mean": float(np.mean([sum(r[2] for r in s.rows) for s in steps])),
            "prefill_tokens": int(sum(s.prefill_tokens() for s in steps)),
            "streamed": int(sum(s.streamed() for s in steps)),
            "corun_mean": float(np.mean([corun[id(s)] for s in steps])),
            "loop_gap_ms_mean": float(np.mean(gaps)) * 1e3 if gaps else 0.0,
            "loop_gap_s": float(np.sum(gaps)),
            "long_waits": len(waits),
            "long_wait_s": float(np.sum(waits)),
        }
        if model is not None:
            engine = np.array([price[id(s)] for s in steps])
            d["engine_price_s"] = float(engine.sum())
            d["real_over_engine"] = float(durs.sum() / engine.sum()) if engine.sum() else None
            ratio = durs / np.maximum(engine, 1e-6)
            for label, sel in (("decode", ~mixed), ("mixed", mixed)):
                if sel.any():
                    d[f"ratio_{label}_p50"] = _q(ratio[sel], 0.5)
                    d[f"ratio_{label}_p90"] = _q(ratio[sel], 0.9)
                    d[f"ratio_{label}_sum"] = float(durs[sel].sum() / engine[sel].sum())
            shares = np.array([corun[id(s)] for s in steps])
            for label, sel in (("alone", shares < 0.5), ("corun", shares >= 0.5)):
                if sel.any():
                    d[f"ratio_{label}_sum"] = float(durs[sel].sum() / engine[sel].sum())
            if serving is not None:
                priced = np.array(
                    [serving_step(serving, model, shape[id(s)], s.streamed(), corun[id(s)])
                     for s in steps]
                )  # fmt: skip
                d["serving_price_s"] = float(priced.sum())
                d["real_over_serving"] = float(durs.sum() / priced.sum()) if priced.sum() else None
        out[name] = d
    return out


ROWS = (
    ("steps", "{:.0f}"), ("busy_s", "{:.1f}"), ("span_s", "{:.1f}"), ("step_ms_p50", "{:.1f}"),
    ("step_ms_p99", "{:.1f}"), ("step_ms_mean", "{:.1f}"), ("mixed_share", "{:.3f}"),
    ("decode_batch_mean", "{:.2f}"), ("tokens_mean", "{:.1f}"), ("prefill_tokens", "{:.0f}"),
    ("streamed", "{:.0f}"), ("corun_mean", "{:.3f}"), ("loop_gap_ms_mean", "{:.2f}"),
    ("loop_gap_s", "{:.1f}"), ("long_waits", "{:.0f}"), ("long_wait_s", "{:.1f}"),
    ("engine_price_s", "{:.1f}"), ("real_over_engine", "{:.3f}"), ("ratio_decode_p50", "{:.3f}"),
    ("ratio_decode_p90", "{:.3f}"), ("ratio_decode_sum", "{:.3f}"), ("ratio_mixed_p50", "{:.3f}"),
    ("ratio_mixed_p90", "{:.3f}"), ("ratio_mixed_sum", "{:.3f}"), ("ratio_alone_sum", "{:.3f}"),
    ("ratio_corun_sum", "{:.3f}"), ("serving_price_s", "{:.1f}"), ("real_over_serving", "{:.3f}"),
)  # fmt: skip


def format_table(columns: dict[str, dict]) -> str:
    """Columns (a label each: a trace's `summarise()["all"]` or one replica's) by row."""
    labels = list(columns)
    width = max([12, *(len(label) + 1 for label in labels)])
    lines = [f"{'':20s}" + "".join(f"{label:>{width}s}" for label in labels)]
    for key, fmt in ROWS:
        if not any(key in c for c in columns.values()):
            continue
        cells = []
        for label in labels:
            v = columns[label].get(key)
            cells.append(f"{'-' if v is None else fmt.format(v):>{width}s}")
        lines.append(f"{key:20s}" + "".join(cells))
    return "\n".join(lines)


def price_level(ratios: list[float]) -> dict | None:
    """The served price level of several traces (each one's `real_over_serving`): its median,
    its geometric mean (`level`: `SimSettings.host_level`) and the standard deviation of its
    log, which over replays of one trace at different hours is the host's spread
    (`SimSettings.host_spread`); None for fewer than two."""
    logs = [math.log(r) for r in ratios if r and r > 0]
    if len(logs) < 2:
        return None
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (len(logs) - 1))
    return {
        "traces": len(logs),
        "median": float(np.median(np.exp(logs))),
        "level": math.exp(mean),
        "log_sd": sd,
    }


def summarise_file(path: str | Path, record: str | Path | None = None, profile=None) -> dict:
    """`summarise` of a trace file, only the steps of a replay record's run when given; a
    ValueError when there are none."""
    trace = read_trace(path, *window_of(record)) if record else read_trace(path)
    if not trace:
        raise ValueError(f"{path}: no steps" + (f" in {record}'s run" if record else ""))
    return summarise(trace, profile)


def overall(summary: dict) -> dict:
    """The whole trace's column: "all", or its only replica's."""
    return summary.get("all") or next(iter(summary.values()))


# -- the serving step terms, fitted on served steps ------------------------------------------------
STEP_TERMS = ("corun", "prefill_extra", "step_s", "token_s")
POOR_STEP_MEDIAN = 0.10  # a group of steps priced off by more than this at the median: poor fit


def step_rows(trace: dict[str, list[TracedStep]], model) -> list[tuple[str, float, float, tuple]]:
    """Per step: (group, its cycle, its Engine.step price, the terms' features). The cycle is
    the step and the loop's gap to the replica's next step when that one follows at once (the
    simulator runs steps back to back); the features are what `serving_step` multiplies its
    coefficients by: the price times the co-running share, the prefill part, 1, the tokens
    streamed. Groups: decode-only or mixed, alone or co-running (share under or over 1/2)."""
    corun = corun_shares(trace)
    rows = []
    for steps in trace.values():
        for a, b in zip(steps, [*steps[1:], None]):
            cycle = a.dur
            gap = follow_gap(a, b) if b is not None else None
            if gap is not None and gap <= LOOP_GAP_S:
                cycle += gap
            shape = a.shape()
            price = model.predict(shape)
            share = corun[id(a)]
            kind = "mixed" if a.prefill_tokens() else "decode"
            group = f"{kind} {'corun' if share >= 0.5 else 'alone'}"
            features = (price * share, prefill_part(model, shape), 1.0, float(a.streamed()))
            rows.append((group, cycle, price, features))
    return rows


def fit_steps(traces: list[dict[str, list[TracedStep]]], model) -> dict:
    """The serving step terms (`serving_step`: corun, prefill_scale, step_s, token_s) fitted to
    the served steps of `traces` (each one cluster's: co-running is measured within a trace):
    least squares (`robust_lstsq`) of each cycle's excess over its Engine.step price on the
    features, each group weighing the same and within a group absolute error, outliers rejected
    and refitted. Returns the terms, per-group errors (with each group's summed time against
    its price) and warnings."""
    rows = [row for trace in traces for row in step_rows(trace, model)]
    if len(rows) < 4 * len(STEP_TERMS):
        raise ValueError(f"{len(rows)} steps cannot fit {len(STEP_TERMS)} step terms")
    groups = [g for g, _, _, _ in rows]
    y = np.array([c for _, c, _, _ in rows])
    known = np.array([p for _, _, p, _ in rows])
    x = np.array([f for _, _, _, f in rows])
    count = {g: groups.count(g) for g in set(groups)}
    # each group weighs the same, and within one a step by its time (absolute error: the
    # simulator needs the sum of the steps right, which relative error would give to the many
    # short ones)
    mean = {g: float(np.mean([c for name, c in zip(groups, y) if name == g])) for g in count}
    w = np.array([1.0 / (math.sqrt(count[g]) * max(mean[g], 1e-6)) for g in groups])
    coef, rel, keep = robust_lstsq(x, y, known, w, min_kept=4 * len(STEP_TERMS), rounds=8)
    values = dict(zip(STEP_TERMS, (float(c) for c in coef), strict=True))
    errors, warnings = group_errors(groups, rel, keep), []
    for g, e in errors.items():
        idx = np.array([i for i, name in enumerate(groups) if name == g])
        e["sum_error"] = float((known[idx] + x[idx] @ coef).sum() / y[idx].sum() - 1.0)
        if e["median_abs_rel_error"] > POOR_STEP_MEDIAN:
            warnings.append(
                f"poor fit: {g} steps priced {e['median_abs_rel_error']:.0%} off at the "
                f"median (limit {POOR_STEP_MEDIAN:.0%})"
            )
    return {
        "corun": values["corun"],
        "prefill_scale": 1.0 + values["prefill_extra"],
        "step_s": values["step_s"],
        "token_s": values["token_s"],
        "steps": len(rows),
        "rejected": int((~keep).sum()),
        "fit_error": errors,
        "warnings": warnings,
    }


# -- a replay's first tokens, split by the server's step trace ------------------------------------
TTFT_PARTS = (
    ("path_in", "client send -> the front hands it to the core"),
    ("handoff", "-> the core reads it (it reads between steps)"),
    ("core_wait", "-> first scheduled"),
    ("prefill", "-> the end of the step that samples its first token"),
    ("path_out", "-> the client has the first token"),
)


def ttft_parts(trace_path: str | Path, record: str | Path) -> dict:
    """Each request of a replay record (bench/trace_replay.py) matched to the core's `add` and
    steps in the trace (same prompt length, the first arrival after its send), its TTFT split
    into TTFT_PARTS; returns per part the mean, p50 and p90 in seconds, and the matched count.
    The trace must hold `add` lines (the engine core's; the simulator writes none)."""
    with open(record) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    t0, t1 = window_of(record, lines[0] if lines else {})
    rows = [d for d in lines if d.get("type") == "request"]
    adds: dict[str, dict] = {}
    scheduled: dict[str, float] = {}
    first: dict[str, tuple[float, int]] = {}
    with _open_text(trace_path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if d.get("ev") == "add":
                if t0 - 1.0 <= d["t"] <= t1 + 1.0:
                    adds[d["rid"]] = d
            elif d.get("ev") == "step":
                for rid, start, tokens, drafts, prompt in d["reqs"]:
                    if rid not in adds:
                        continue
                    scheduled.setdefault(rid, d["t"] - d["dur"])
                    if start + tokens - drafts >= prompt and rid not in first:
                        first[rid] = (d["t"], prompt)
    if not adds:
        raise ValueError(
            f"{trace_path}: no `add` lines in {record}'s run (an engine core's trace?)"
        )
    by_len: dict[int, list[str]] = {}
    for rid, (_, prompt) in first.items():
        by_len.setdefault(prompt, []).append(rid)
    used: set[str] = set()
    parts: list[tuple[float, ...]] = []
    for row in rows:
        if not row.get("success") or row.get("ttft_s") is None:
            continue
        send = t0 + row["start_s"]
        candidates = [rid for rid in by_len.get(row["prompt_tokens"], ())
                      if rid not in used and adds[rid]["arrival"] >= send - 0.01]  # fmt: skip
        if not candidates:
            continue
        rid = min(candidates, key=lambda r: adds[r]["arrival"])
        used.add(rid)
        add = adds[rid]
        end = first[rid][0]
        parts.append((add["arrival"] - send, add["t"] - add["arrival"], scheduled[rid] - add["t"],
                      end - scheduled[rid], send + row["ttft_s"] - end, row["ttft_s"]))  # fmt: skip
    out: dict = {"requests": len(rows), "matched": len(parts)}
    if parts:
        a = np.array(parts)
        for i, name in enumerate([n for n, _ in TTFT_PARTS] + ["ttft"]):
            out[name] = {"mean": float(a[:, i].mean()), "p50": _q(a[:, i], 0.5),
                         "p90": _q(a[:, i], 0.9)}  # fmt: skip
    return out


def format_ttft(label: str, parts: dict) -> str:
    lines = [f"{label}: TTFT split, {parts['matched']} of {parts['requests']} requests matched "
             "(ms: mean / p50 / p90)"]  # fmt: skip
    for name, about in [*TTFT_PARTS, ("ttft", "the whole first token")]:
        if name in parts:
            p = parts[name]
            lines.append(f"  {name:10s} {p['mean'] * 1e3:9.1f} {p['p50'] * 1e3:9.1f} "
                         f"{p['p90'] * 1e3:9.1f}  {about}")  # fmt: skip
    return "\n".join(lines)
