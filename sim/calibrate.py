"""Serving calibration: what a step costs in a serving replica beyond `Engine.step` alone, and
how long a request takes to reach a replica and its tokens to come back.

A profile times `Engine.step` in a quiet process. Serving adds work the engine does not see:
each streamed token crosses the replica's event loop, Ray's streaming, the ingress and the HTTP
proxy, and on a small host those processes take the cores the forward runs on. The simulator
prices a serving step as (`serving_step`)

    served step = Engine.step(shape) * (1 + corun * busy)
                  + (prefill_scale - 1) * prefill part of Engine.step
                  + step_s + token_s * (tokens the step streams)

where busy is the share of the other replicas of its host (the calibration's N replicas share
one) that are running steps when it starts: replicas on one host slow each other down (shared
cores, caches and memory bandwidth; on a small host the slowdown is ~1.5x, far more than the
serving path's own CPU), which a profile timed in a quiet process cannot see,

and the one-way path client -> replica as `path_latency_s + path_rate_s * R`, R the tokens per
second the host streams (its replicas together; the proxy and ingress serve them all). All six
coefficients are signed: a profile slower than the cluster gets negative corrections, not
zeros, and a poor fit is reported (`warnings`), not hidden.

With the clusters' step traces (STEPSERVE_STEP_TRACE; `stepserve profile` has the clusters it
starts write them) the four step terms are fitted on the served steps themselves
(sim/steptrace.py `fit_steps`: each step's time against its shape's price, its co-running share
and streamed tokens as measured) and the measurements below fit only the path's two; without,
all six are fitted together, by least squares on relative error with outliers rejected (median and
MAD of the residuals), over repeated measurements against a running cluster of N replicas
(`stepserve profile` starts one; `--calibrate-url URL --calibrate-replicas N` uses yours):
- decode: closed-loop streams (64-token prompts, 24-72 tokens out) at N x (1, 2, 4, 8, 16, 32)
  concurrency, the levels run `rounds` times in turn; each stream's time per output token is
  the mean served step of a replica with b = concurrency / N streams, which includes the steps
  where another stream's prompt or a probe's was prefilled (priced as such, not as pure decode
  steps: at one replica and one stream, the probes alone add ~10% to the time per token);
- probes under load: beside each level, sequential 16-token prompts with max_tokens 1: TTFT =
  2 x path at that streaming rate + the wait for the step under way + the probe's mixed step;
- prefill: one stream per replica of 256- and 1024-token prompts, max_tokens 1 (every replica
  prefilling at once, as under load): TTFT = 2 x path + the served prefill step;
- idle probes: 16-token prompts, max_tokens 1, one at a time on the idle cluster;
- alone on the N-replica cluster (N > 1): one stream at a time for 2 x the level's seconds, the
  other replicas idle (busy 0);
- solo (N > 1 and a cluster it starts: `solo_url`): the idle probes, decode levels 1, 4 and 16
  and the 256-token prefill once more on a one-replica cluster, where no other replica's steps
  run beside a step (busy 0); the N-replica levels run with every replica busy (busy 1), which
  separates `corun` from the path's own cost.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass

import numpy as np

from sim.profile import (  # noqa: F401  (prefill_part, serving_step: this module's model)
    SERVING_MODEL,
    Profile,
    StepShape,
    StepTimeModel,
    group_errors,
    prefill_part,
    robust_lstsq,
    serving_step,
)

BATCHES = (1, 2, 4, 8, 16, 32)  # streams per replica at each decode level
COEFFICIENTS = ("step_s", "token_s", "prefill_extra", "path_latency_s", "path_rate_s", "corun")
SOLO_BATCHES = (1, 4, 16)  # decode levels measured again on one replica (busy 0)
PROBE_TOKENS = 16
POOR_GROUP_MEDIAN = 0.10  # a group of measurements priced off by more than this: poor fit


# -- the model -----------------------------------------------------------------------------------
def path_extra(serving: dict, host_tokens_per_s: float) -> float:
    """One-way path latency beyond the idle one when the host streams this many tokens/s."""
    extra = serving.get("path_rate_s", 0.0) * host_tokens_per_s
    return max(extra, -serving.get("path_latency_s", 0.0))


# -- measurements as rows of the least-squares problem -------------------------------------------
@dataclass
class Row:
    """One measurement: y (seconds) = known (the profile's Engine.step part) + x . coefficients."""

    group: str  # decode | probe | prefill | idle
    level: str  # which batch, prompt or load it was measured at
    y: float
    known: float
    x: tuple[float, float, float, float, float, float]

    def as_dict(self) -> dict:
        """As the profile stores it (`serving.rows`)."""
        return {"group": self.group, "level": self.level, "y": self.y, "known": self.known,
                "x": list(self.x)}  # fmt: skip

    @classmethod
    def of_dict(cls, d: dict) -> Row:
        return cls(d["group"], d["level"], d["y"], d["known"], tuple(d["x"]))


def probe_window(seconds: float) -> tuple[float, float]:
    """When a level's prober sends (`_closed_loop`): from this many seconds after the level's
    start (the streams reach their steady state) until this many before its end."""
    return min(1.0, seconds / 4), 0.5


def probing_seconds(seconds: float) -> float:
    """How long a level of `seconds` has its prober running (the probes' rate divides by it)."""
    start, end = probe_window(seconds)
    return max(seconds - start - end, 1e-3)


def decode_row(
    model: StepTimeModel,
    batch: int,
    prompt_len: int,
    out_len: int,
    tpot: float,
    busy: float,
    probe_rate: float = 0.0,
) -> Row:
    """A stream's time per output token with `batch` streams per replica (closed loop): its
    decode steps, of which a share (batch - 1) / out_len also prefill another stream's prompt
    (each stream prefills once per out_len steps, out_len its mean output: the streams' lengths
    differ so they do not march in step), and a share `probe_rate` x `tpot` (the level's probes
    per second on this replica, one per step at most) also prefill a probe's prompt. Every step
    streams `batch` tokens."""
    ctx = prompt_len + out_len // 2
    decode = model.predict(StepShape.of([], [ctx] * batch))
    q = min(1.0, (batch - 1) / max(out_len, 1))
    mixed_shape = StepShape.of([(prompt_len, 0)], [ctx] * (batch - 1))
    known = (1 - q) * decode + q * model.predict(mixed_shape)
    pre = q * prefill_part(model, mixed_shape)
    f = min(1.0, max(probe_rate, 0.0) * tpot)
    if f > 0:  # a probe's prefill joins the step: what it adds to the stream's step
        probe_shape = StepShape.of([(PROBE_TOKENS, 0)], [ctx] * batch)
        known += f * (model.predict(probe_shape) - decode)
        pre += f * prefill_part(model, probe_shape)
    level = f"b={batch}" + ("" if busy else " solo")
    return Row("decode", level, tpot, known, (1.0, float(batch), pre, 0.0, 0.0, busy * known))


def probe_row(
    model: StepTimeModel, batch: int, ctx: int, ttft: float, rate: float, busy: float
) -> Row:
    """A 16-token prompt's TTFT (max_tokens 1) beside `batch` decoding streams per replica:
    2 x path at the streaming rate + half a served decode step (the wait for the step under way)
    + its own step (its prefill and the batch's decodes, streaming batch + 1 tokens)."""
    shape = StepShape.of([(PROBE_TOKENS, 0)], [ctx] * batch)
    known = model.predict(shape)
    step, token = 1.0, batch + 1.0
    if batch:
        known += 0.5 * model.predict(StepShape.of([], [ctx] * batch))
        step, token = 1.5, batch + 1.0 + 0.5 * batch
    x = (step, token, prefill_part(model, shape), 2.0, 2.0 * rate, busy * known)
    level = f"b={batch}" + ("" if busy or not batch else " solo")
    return Row("probe" if batch else "idle", level, ttft, known, x)


def prefill_row(
    model: StepTimeModel, prompt_len: int, ttft: float, rate: float, busy: float
) -> Row:
    """A prompt's TTFT (max_tokens 1, nothing else on its replica): 2 x path + its served step."""
    shape = StepShape.of([(prompt_len, 0)], [])
    known = model.predict(shape)
    level = f"p={prompt_len}" + ("" if busy else " solo")
    x = (1.0, 1.0, known, 2.0, 2.0 * rate, busy * known)
    return Row("prefill", level, ttft, known, x)


def fit_serving(rows: list[Row], fixed: dict[str, float] | None = None) -> dict:
    """Least squares of the rows' residuals (y - known) on their x, weighted by 1/y (relative
    error) and 1/sqrt(rows in the group) (each group counts the same), outliers (OUTLIER_MADS
    scaled MADs and OUTLIER_FLOOR off) rejected and refitted; coefficients signed. `fixed`:
    coefficients already known (the step terms fitted on the served steps, sim/steptrace.py
    `fit_steps`), moved into `known`; the rest are fitted. Returns the serving dict's
    coefficients, per-group errors (over every row: with fixed step terms the decode rows are a
    check of them), rejected counts and warnings."""
    fixed = fixed or {}
    unknown = set(fixed) - set(COEFFICIENTS)
    if unknown:
        raise ValueError(f"no serving coefficients {sorted(unknown)}; known: {COEFFICIENTS}")
    if len(rows) < len(COEFFICIENTS) - len(fixed):
        raise ValueError(f"{len(rows)} measurements cannot fit {len(COEFFICIENTS)} coefficients")
    y = np.asarray([r.y for r in rows])
    x = np.asarray([r.x for r in rows])
    pinned = np.asarray([fixed.get(name, 0.0) for name in COEFFICIENTS])
    known = np.asarray([r.known for r in rows]) + x @ pinned
    x = x * np.asarray([0.0 if name in fixed else 1.0 for name in COEFFICIENTS])
    # relative error, and each group (decode, probe, prefill, idle) weighs the same in all:
    # hundreds of decode streams would otherwise drown a dozen idle probes
    count: dict[str, int] = {}
    for r in rows:
        count[r.group] = count.get(r.group, 0) + 1
    w = np.asarray([1.0 / math.sqrt(count[r.group]) for r in rows]) / np.maximum(y, 1e-6)
    # a coefficient no row measures stays 0 (e.g. no load: no path rate)
    coef, rel, keep = robust_lstsq(x, y, known, w, min_kept=len(COEFFICIENTS), rounds=5)
    values = dict(zip(COEFFICIENTS, (float(c) for c in coef + pinned), strict=True))
    groups = group_errors([r.group for r in rows], rel, keep)
    warnings = []
    for g, e in groups.items():
        if e["median_abs_rel_error"] > POOR_GROUP_MEDIAN:
            warnings.append(
                f"poor fit: {g} measurements priced {e['median_abs_rel_error']:.0%} off at the "
                f"median (limit {POOR_GROUP_MEDIAN:.0%})"
            )
    scale = 1.0 + values["prefill_extra"]
    if not 0.5 <= scale <= 3.0:
        warnings.append(
            f"prefill_scale {scale:.2f} is outside 0.5..3: the profile does not price this "
            "cluster's prefill (another CPU, or a busy host while profiling?)"
        )
    if not -0.2 <= values["corun"] <= 3.0:
        warnings.append(
            f"corun {values['corun']:.2f} is outside -0.2..3: replicas of one host do not slow "
            "each other down this way (a busy host while calibrating?)"
        )
    if values["path_latency_s"] < 0:
        warnings.append(f"path latency {values['path_latency_s'] * 1e3:.1f} ms < 0: a mis-fit")
    rejected = int((~keep).sum())
    if rejected > max(3, len(rows) // 10):
        warnings.append(f"{rejected} of {len(rows)} measurements rejected as outliers")
    return {
        "model": SERVING_MODEL,
        "step_s": values["step_s"],
        "token_s": values["token_s"],
        "prefill_scale": scale,
        "path_latency_s": values["path_latency_s"],
        "path_rate_s": values["path_rate_s"],
        "corun": values["corun"],
        "fit_error": groups,
        "warnings": warnings,
    }


# -- measuring -----------------------------------------------------------------------------------
async def _stream(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """One streamed completion: (TTFT, seconds per output token after the first, tokens)."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    first = None
    n = 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or '"token_ids"' not in line:
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            for choice in json.loads(data).get("choices") or []:
                k = len(choice.get("token_ids") or [])
                if k and first is None:
                    first = time.perf_counter()
                n += k
    end = time.perf_counter()
    ttft = (first or end) - t0
    return ttft, (end - (first or end)) / max(n - 1, 1), n


@dataclass
class LevelRun:
    streams: list[tuple[float, float, int]]  # (TTFT, time per token, tokens) per stream
    probes: list[float]  # probe TTFTs
    tokens_per_s: float  # tokens the streams got per second, all together


async def _closed_loop(
    base_url: str,
    concurrency: int,
    prompt_len: int,
    out_len: int,
    seconds: float,
    seed: int,
    probe: bool = False,
    at_least_one: bool = False,
) -> LevelRun:
    """`concurrency` streams of random prompts (outputs of out_len tokens on average), each sent
    when the last ended, for `seconds`
    (and until one has ended, with `at_least_one`); with `probe`, beside them one client sends
    PROBE_TOKENS-token prompts with max_tokens 1, one at a time, 0.25 s apart."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    run = LevelRun([], [], 0.0)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            while time.perf_counter() < deadline or (at_least_one and not run.streams):
                prompt = [rng.randrange(10, 500) for _ in range(prompt_len)]
                # output lengths spread over out_len/2 .. 3 out_len/2 (mean out_len), so that the
                # streams do not march in step (all prefilling together, then all decoding)
                n = rng.randint(max(1, out_len - out_len // 2), out_len + out_len // 2)
                run.streams.append(await _stream(client, url, prompt, n))

        async def prober() -> None:
            start, end = probe_window(seconds)
            await asyncio.sleep(start)
            while time.perf_counter() < deadline - end:
                prompt = [rng.randrange(10, 500) for _ in range(PROBE_TOKENS)]
                ttft, _, _ = await _stream(client, url, prompt, 1)
                run.probes.append(ttft)
                await asyncio.sleep(0.25)

        await asyncio.gather(
            *(worker() for _ in range(concurrency)), *([prober()] if probe else [])
        )
    run.tokens_per_s = sum(n for _, _, n in run.streams) / (time.perf_counter() - t0)
    return run


def _idle_probes(base_url: str, n: int) -> list[float]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"

    async def run() -> list[float]:
        out = []
        async with httpx.AsyncClient(timeout=120) as client:
            for i in range(n + 2):
                prompt = [random.Random(i).randrange(10, 500) for _ in range(PROBE_TOKENS)]
                ttft, _, _ = await _stream(client, url, prompt, 1)
                if i >= 2:  # the first ones warm the path
                    out.append(ttft)
                await asyncio.sleep(0.2)
        return out

    return asyncio.run(run())


def measure_rows(
    base_url: str,
    profile: Profile,
    replicas: int,
    batches: tuple[int, ...] = BATCHES,
    prompt_len: int = 64,
    out_len: int = 48,
    seconds: float = 12.0,
    rounds: int = 2,
    prefill_prompts: tuple[int, ...] = (256, 1024),
    idle_probes: int = 12,
    seed: int = 0,
    progress=print,
) -> list[Row]:
    """The measurements of a running cluster of `replicas` (module docstring) as rows; with
    several replicas every loaded level runs all of them at once (busy 1), with one none other
    (busy 0). Levels beyond the engine's max_num_seqs are skipped."""
    model = profile.model
    max_seqs = profile.engine.get("max_num_seqs", 256)
    batches = tuple(b for b in batches if b <= max_seqs)
    busy = 1.0 if replicas > 1 else 0.0
    tag = "" if busy else " (one replica)"
    rows: list[Row] = []
    ctx = prompt_len + out_len // 2
    for ttft in _idle_probes(base_url, idle_probes):
        rows.append(probe_row(model, 0, ctx, ttft, 0.0, 0.0))
    progress(f"  idle probes{tag}: TTFT median {statistics.median(r.y for r in rows) * 1e3:.1f} ms")
    if busy:  # one stream at a time: a replica's steps with the others idle (busy 0), on a host
        # of N replicas (their idle processes and pinned cores are there, as when a light load
        # leaves one busy), which a one-replica cluster is not
        run = asyncio.run(
            _closed_loop(base_url, 1, prompt_len, out_len, seconds * rounds, seed + 5)
        )
        tpots = [tpot for _, tpot, n in run.streams if n > 1]
        rows += [decode_row(model, 1, prompt_len, out_len, t, 0.0) for t in tpots]
        if tpots:
            progress(
                f"  one stream, the other replicas idle: time per token "
                f"{statistics.median(tpots) * 1e3:7.2f} ms, {run.tokens_per_s:.0f} tok/s"
            )
    for rnd in range(rounds):
        order = batches if rnd % 2 == 0 else tuple(reversed(batches))  # drift averages out
        for b in order:
            c = b * replicas
            run = asyncio.run(
                _closed_loop(
                    base_url, c, prompt_len, out_len, seconds, seed + 97 * rnd + c, probe=True
                )
            )
            tpots = [tpot for _, tpot, n in run.streams if n > 1]
            # the probes share the replicas' steps with the streams
            rate = len(run.probes) / probing_seconds(seconds) / replicas
            rows += [decode_row(model, b, prompt_len, out_len, t, busy, rate) for t in tpots]
            rows += [probe_row(model, b, ctx, t, run.tokens_per_s, busy) for t in run.probes]
            if tpots:
                progress(
                    f"  round {rnd + 1} batch {b:3d} ({c} streams){tag}: time per token "
                    f"{statistics.median(tpots) * 1e3:7.2f} ms (Engine.step decode "
                    f"{model.predict(StepShape.of([], [ctx] * b)) * 1e3:.2f} ms), probe TTFT "
                    f"{statistics.median(run.probes) * 1e3 if run.probes else math.nan:.1f} "
                    f"ms, {run.tokens_per_s:.0f} tok/s"
                )
        for p in prefill_prompts:
            run = asyncio.run(
                _closed_loop(
                    base_url, replicas, p, 1, seconds / 2, seed + 31 * rnd + p, at_least_one=True
                )
            )
            rate = run.tokens_per_s
            rows += [prefill_row(model, p, ttft, rate, busy) for ttft, _, _ in run.streams]
            progress(
                f"  round {rnd + 1} prefill {p:5d} tokens, {replicas} at once: TTFT "
                f"{statistics.median(t for t, _, _ in run.streams) * 1e3:8.1f} ms, Engine.step "
                f"{model.predict(StepShape.of([(p, 0)], [])) * 1e3:8.1f} ms"
            )
    return rows


def measure_solo(base_url: str, profile: Profile, seconds: float = 12.0, progress=print):
    """The solo rows (module docstring) of a one-replica cluster at `base_url`."""
    return measure_rows(
        base_url, profile, 1, batches=SOLO_BATCHES, seconds=seconds, rounds=1,
        prefill_prompts=(256,), idle_probes=6, seed=7, progress=progress,
    )  # fmt: skip


def fit_step_traces(paths, model, progress=print) -> dict | None:
    """`fit_steps` of the calibration clusters' step traces (each path one cluster's), or None
    when there are none or too few steps (the rows alone then fit every term)."""
    from sim.steptrace import fit_steps, read_trace

    traces = []
    for path in paths:
        try:
            trace = read_trace(path)
        except OSError as exc:
            progress(f"  no step trace {path}: {exc}")
            continue
        if trace:
            traces.append(trace)
    if not traces:
        return None
    try:
        return fit_steps(traces, model)
    except ValueError as exc:
        progress(f"  step traces not fitted: {exc}")
        return None


def measure_serving(
    base_url: str,
    profile: Profile,
    replicas: int,
    seconds: float = 12.0,
    solo_rows: list[Row] | tuple = (),
    progress=print,
    step_traces=(),
    **levels,
) -> dict:
    """The serving calibration of a running cluster of `replicas` (module docstring), with the
    solo rows of a one-replica cluster measured before (`measure_solo`): the measurements, then
    `fit_serving`. `step_traces`: the clusters' step traces (STEPSERVE_STEP_TRACE) over the
    measurements; when given, the step terms are fitted on the served steps themselves
    (sim/steptrace.py `fit_steps`) and the rows fit the path's."""
    from sim.host import CpuTimes

    start = CpuTimes.now()
    rows = list(solo_rows) + measure_rows(
        base_url, profile, replicas, seconds=seconds, progress=progress, **levels
    )
    steps = fit_step_traces(step_traces, profile.model, progress) if step_traces else None
    fixed = None
    if steps is not None:
        fixed = {name: steps[name] for name in ("step_s", "token_s", "corun")}
        fixed["prefill_extra"] = steps["prefill_scale"] - 1.0
    serving = fit_serving(rows, fixed)
    if steps is not None:
        serving["step_fit"] = {k: steps[k] for k in ("steps", "rejected", "fit_error")}
        serving["warnings"] = [*steps["warnings"], *serving["warnings"]]
    end = CpuTimes.now()
    batches = tuple(
        b for b in levels.get("batches", BATCHES) if b <= profile.engine.get("max_num_seqs", 256)
    )
    serving.update(
        # the fitted overhead of a decode step at each measured batch (for reports; the layout
        # 1 names, so its readers print it as before)
        batches=list(batches),
        extra_s=[serving["step_s"] + serving["token_s"] * b for b in batches],
        replicas=replicas,
        rows=[r.as_dict() for r in rows],
        host={"loadavg_start": list(start.loadavg), "loadavg_end": list(end.loadavg)},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    return serving


def describe(serving: dict) -> str:
    """One line of a serving calibration's coefficients."""
    return (
        f"per step {serving['step_s'] * 1e3:+.2f} ms, per streamed token "
        f"{serving['token_s'] * 1e3:+.3f} ms, prefill x{serving['prefill_scale']:.2f}, path "
        f"{serving['path_latency_s'] * 1e3:.2f} ms one way "
        f"{serving['path_rate_s'] * 1e6:+.2f} ms per 1000 tok/s streamed, co-running "
        f"replicas x{1 + serving.get('corun', 0.0):.2f}"
        + (f", host spread {serving['host_spread']:.3f}" if serving.get("host_spread") else "")
    )
