"""Step-time profiles: `stepserve profile` times real engine steps (schedule, forward, sample,
detokenize: the whole `Engine.step`) over a grid of step shapes on the machine it runs on, and
fits the model the simulator uses to price a step it did not measure.

Grid (each point timed several times; samples more than OUTLIER_MADS scaled MADs from the
median are rejected and the point is the median of the rest; every sample is kept):
- decode: n sequences of context L each (distinct prompts, so the KV read is real);
- prefill: one chunk of c new tokens after o tokens already cached (a prefix-cache hit of o);
- mixed: n decodes plus one prefill chunk in the same step (held out of the fit: they measure
  how well the model prices steps it was not fitted on).

Model (the step's time from its shape, linear in its coefficients, fitted by least squares):

    t = g(T) + a_causal * sum_{chunks with o = 0} c * (c + 1) / 2
             + a_prefix * sum_{chunks with o > 0} c * (o + (c + 1) / 2)
             + a_decode * sum_decodes ctx + a_seq * (requests - 1)

T is the step's scheduled tokens and g is piecewise linear over knots at the measured T values
(the weights' matmuls, sampling and per-step costs, which grow unevenly with the batch: small
batches are bound by reading the weights); the attention terms are the query-key pairs of each
prefill chunk (causal within the chunk, all of the cached prefix) and the context each decode
reads; `requests` are the step's scheduled requests (each one's sampling, bookkeeping and
detokenizing, beyond the first). A chunk with nothing cached before it and one after a prefix-cache hit (or an earlier
chunk) take different attention paths in the runner (a causal kernel, and attention over the
cached prefix plus the chunk), so each has its own coefficient. Beyond the last knot g continues
along its last segment. Points the fit prices as outliers are rejected and the fit repeated;
what it rejected, and terms it could not resolve, are in the model's `notes`.

A profile records the CPU (model, ISA level) and the host's load while it ran (sim/host.py), so
that `Profile.warnings` can say when it was taken on a busy host or fits poorly. The serving
calibration (sim/calibrate.py) is stored beside the fit (`Profile.serving`, layout
SERVING_MODEL; older layouts are converted on load by `upgrade_serving`).
"""

from __future__ import annotations

import json
import logging
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

PROFILES = Path(__file__).resolve().parent / "profiles"
FORMAT_VERSION = 4
SERVING_MODEL = 2  # the serving dict's layout (1: interpolated per-batch differences)
READABLE_FORMATS = (3, 4)  # 3: before host load, samples and serving model 2
_TERMS = ("a_causal", "a_prefix", "a_decode", "a_seq")


@dataclass(frozen=True)
class StepShape:
    """What the model prices: the step's tokens and its attention work."""

    tokens: int  # T: scheduled tokens
    causal_pairs: float  # sum over prefill chunks with o == 0 of c * (c + 1) / 2
    prefix_pairs: float  # sum over prefill chunks with o > 0 of c * (o + (c + 1) / 2)
    decode_context: float  # sum over decodes of the context read
    requests: int = 1  # scheduled requests
    decodes: int = 0  # of them, one-token decodes

    @classmethod
    def of(cls, prefill: list[tuple[int, int]], decode_contexts: list[int]) -> StepShape:
        """From (c, o) prefill chunks and decode contexts."""
        tokens = sum(c for c, _ in prefill) + len(decode_contexts)
        causal = sum(c * (c + 1) / 2 for c, o in prefill if o == 0)
        prefix = sum(c * (o + (c + 1) / 2) for c, o in prefill if o > 0)
        n = len(prefill) + len(decode_contexts)
        return cls(tokens, causal, prefix, float(sum(decode_contexts)), n, len(decode_contexts))

    def decode_part(self) -> StepShape:
        """The same step without its prefill chunks."""
        return StepShape(self.decodes, 0.0, 0.0, self.decode_context, self.decodes, self.decodes)

    def features(self) -> tuple[float, float, float, float]:
        return (self.causal_pairs, self.prefix_pairs, self.decode_context, self.requests - 1)

    @classmethod
    def of_scheduler_output(cls, so) -> StepShape:
        """The shape of a `replica.scheduler.SchedulerOutput` (as the real runner would run it:
        a one-token chunk at the end of the known tokens is a decode)."""
        tokens = decodes = 0
        causal = prefix = context = 0.0
        for s in so.scheduled:
            c = s.num_tokens
            o = s.start
            tokens += c
            if c == 1 and o >= s.request.num_prompt_tokens:
                context += o + 1
                decodes += 1
            elif o == 0:
                causal += c * (c + 1) / 2
            else:
                prefix += c * (o + (c + 1) / 2)
        return cls(tokens, causal, prefix, context, len(so.scheduled), decodes)


class StepTimeModel:
    """The fitted model of a profile (module docstring): g's knots and values, and the
    per-step-shape coefficients (a_causal, a_prefix, a_decode, a_seq)."""

    def __init__(self, knots: list[float], values: list[float], attention: list[float]) -> None:
        if len(knots) != len(values) or not knots or len(attention) != len(_TERMS):
            raise ValueError(
                f"a step-time model needs a value per knot and {len(_TERMS)} shape terms"
            )
        self.knots = [float(k) for k in knots]
        self.values = [float(v) for v in values]
        self.attention = [float(a) for a in attention]
        self.notes: dict = {}  # what the fit rejected and dropped (fit())
        self._knots = np.asarray(self.knots)
        self._values = np.asarray(self.values)
        if len(knots) >= 2:
            self._slope = (self.values[-1] - self.values[-2]) / (self.knots[-1] - self.knots[-2])
        else:
            self._slope = 0.0

    def tokens_time(self, tokens: float) -> float:
        if tokens >= self.knots[-1]:
            return self.values[-1] + self._slope * (tokens - self.knots[-1])
        return float(np.interp(tokens, self._knots, self._values))

    def predict(self, shape: StepShape) -> float:
        t = self.tokens_time(shape.tokens)
        for a, f in zip(self.attention, shape.features()):
            t += a * f
        return max(t, 0.0)

    def as_dict(self) -> dict:
        d = {"knots": self.knots, "values": self.values, "attention": self.attention}
        if self.notes:
            d["notes"] = self.notes
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StepTimeModel:
        model = cls(d["knots"], d["values"], d["attention"])
        model.notes = d.get("notes") or {}
        return model


# -- a served step (sim/calibrate.py fits its terms) --------------------------------------------
def prefill_part(model: StepTimeModel, shape: StepShape) -> float:
    """The share of a step's Engine.step price that is its prefill chunks."""
    if shape.tokens <= shape.decodes:
        return 0.0
    return max(0.0, model.predict(shape) - model.predict(shape.decode_part()))


def serving_step(
    serving: dict, model: StepTimeModel, shape: StepShape, streamed: int, busy: float = 0.0
) -> float:
    """A step's serving time (module docstring): the profile's price, slowed by `busy` (the
    share of its host's other replicas in a step) times `corun`, its prefill part times
    `prefill_scale`, a per-step cost and a cost per token it streams (a step that streams none,
    an intermediate prefill chunk, pays no per-token cost)."""
    t = model.predict(shape)
    t *= 1.0 + serving.get("corun", 0.0) * busy
    scale = serving.get("prefill_scale", 1.0)
    if scale != 1.0:
        t += (scale - 1.0) * prefill_part(model, shape)
    t += serving.get("step_s", 0.0) + serving.get("token_s", 0.0) * streamed
    return max(t, 1e-6)  # a fit far below the profile: still a step (and a warning)


def _hat_features(tokens: float, knots: list[float]) -> list[float]:
    """Piecewise-linear basis: the weights of `tokens` on its two neighbouring knots (linear
    continuation past the last)."""
    out = [0.0] * len(knots)
    if len(knots) == 1:
        out[0] = 1.0
        return out
    if tokens <= knots[0]:
        out[0] = 1.0
        return out
    for i in range(1, len(knots)):
        if tokens <= knots[i] or i == len(knots) - 1:
            lo, hi = knots[i - 1], knots[i]
            w = (tokens - lo) / (hi - lo)
            out[i - 1] = 1.0 - w
            out[i] = w
            return out
    return out


OUTLIER_MADS = 3.5  # a point whose relative residual is this many MADs off is rejected
OUTLIER_FLOOR = 0.05  # ... and more than 5% off (a tight fit's MAD is tiny)
FIT_OUTLIER_FLOOR = 0.5  # a grid point is an outlier only if priced 50% off (else: a misfit)
MAX_REJECTED_SHARE = 0.05  # the fit rejects at most this share of the grid's points
POOR_FIT_MEDIAN = 0.10  # grid median relative error above this: the fit is poor
POOR_HELD_OUT_MEDIAN = 0.15  # held-out mixed steps' median relative error above this: poor


def robust_center(samples: list[float], mads: float = OUTLIER_MADS) -> tuple[float, list[bool]]:
    """The median of `samples` after rejecting those more than `mads` scaled MADs (1.4826 MAD,
    the standard deviation of a normal sample) from the median; and which were kept."""
    med = statistics.median(samples)
    mad = statistics.median(abs(x - med) for x in samples) * 1.4826
    if mad <= 0:
        return med, [True] * len(samples)
    keep = [abs(x - med) <= mads * mad for x in samples]
    return statistics.median(x for x, k in zip(samples, keep) if k), keep


def robust_lstsq(
    x: np.ndarray, y: np.ndarray, known: np.ndarray, w: np.ndarray, min_kept: int, rounds: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coefficients c for y ~ known + x @ c by least squares weighted by `w`, on the columns of
    `x` that some row measures (the others stay 0), refitted without the rows whose relative
    residual is OUTLIER_MADS scaled MADs and OUTLIER_FLOOR off the median, until that rejects
    nothing new, `rounds` fits were made, or fewer than `min_kept` rows would be left. Returns
    (c, every row's relative residual, which rows were kept)."""
    free = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(rounds):
        a = x[keep][:, free] * w[keep, None]
        coef[free] = np.linalg.lstsq(a, (y[keep] - known[keep]) * w[keep], rcond=None)[0]
        rel = (known + x @ coef) / y - 1.0
        med = float(np.median(rel[keep]))
        mad = float(np.median(np.abs(rel[keep] - med))) * 1.4826
        new_keep = np.abs(rel - med) <= max(OUTLIER_MADS * mad, OUTLIER_FLOOR)
        if np.array_equal(new_keep, keep) or new_keep.sum() < min_kept:
            break
        keep = new_keep
    return coef, rel, keep


def group_errors(groups: list[str], rel: np.ndarray, keep: np.ndarray) -> dict[str, dict]:
    """Per group (sorted): rows, rejected rows, the median |relative residual| of the kept ones
    (of all when none was kept) and the median residual (bias)."""
    out = {}
    for g in sorted(set(groups)):
        idx = np.array([i for i, name in enumerate(groups) if name == g])
        kept = idx[keep[idx]] if keep[idx].any() else idx
        out[g] = {
            "n": int(len(idx)),
            "rejected": int((~keep[idx]).sum()),
            "median_abs_rel_error": float(np.median(np.abs(rel[kept]))),
            "bias": float(np.median(rel[idx])),
        }
    return out


def _solve(rows: list[list[float]], targets: list[float], drop: set[int]) -> np.ndarray:
    a = np.asarray(rows)
    if drop:
        a = a.copy()
        a[:, sorted(drop)] = 0.0
    coef = np.linalg.lstsq(a, np.asarray(targets), rcond=None)[0]
    coef[sorted(drop)] = 0.0
    return coef


def fit(points: list[dict]) -> StepTimeModel:
    """Least-squares fit of the model to measured points ({"shape": StepShape, "time_s": t}),
    weighted by 1/t so that small steps count as much as big ones (relative error). The worst
    point, while it is a gross outlier (OUTLIER_MADS scaled MADs and FIT_OUTLIER_FLOOR off:
    a host hiccup, not a shape the model misprices), is rejected and the fit repeated, up to
    MAX_REJECTED_SHARE of the points; a shape term whose coefficient comes out negative (attention cannot
    make a step faster: the grid does not resolve it) is dropped and said so. What was
    rejected and dropped is in the model's `notes` (saved with the profile)."""
    if not points:
        raise ValueError("no measured points to fit")
    knots = sorted({float(p["shape"].tokens) for p in points})
    k = len(knots)
    rows = []
    for p in points:
        s: StepShape = p["shape"]
        rows.append(_hat_features(s.tokens, knots) + list(s.features()))
    times = [max(p["time_s"], 1e-6) for p in points]
    keep = [True] * len(points)
    drop: set[int] = set()
    notes: dict = {"rejected": [], "dropped_terms": [], "warnings": []}
    tokens = [p["shape"].tokens for p in points]
    while True:
        use = [i for i in range(len(points)) if keep[i]]
        wrows = [[x / times[i] for x in rows[i]] for i in use]
        coef = _solve(wrows, [1.0] * len(use), drop)
        negative = [c for c in range(k, k + len(_TERMS)) if coef[c] < 0 and c not in drop]
        if negative:
            drop |= set(negative)
            coef = _solve(wrows, [1.0] * len(use), drop)
        rel = (np.asarray(rows) @ coef) / np.asarray(times) - 1.0
        if len(points) - len(use) >= max(1, int(MAX_REJECTED_SHARE * len(points))):
            break
        # the worst point, if it is a gross outlier and not the last one at its token count
        med = float(np.median(rel[use]))
        mad = float(np.median(np.abs(rel[use] - med))) * 1.4826
        limit = max(OUTLIER_MADS * mad, FIT_OUTLIER_FLOOR)
        worst = max(use, key=lambda i: abs(rel[i] - med))
        alone = sum(1 for i in use if tokens[i] == tokens[worst]) == 1
        if abs(rel[worst] - med) <= limit or alone:
            break
        keep[worst] = False
    notes["rejected"] = [
        {"desc": points[i].get("desc", ""), "time_s": times[i], "rel_error": float(rel[i])}
        for i in range(len(points))
        if not keep[i]
    ]
    notes["dropped_terms"] = [_TERMS[c - k] for c in sorted(drop)]
    for name in notes["dropped_terms"]:
        notes["warnings"].append(
            f"{name} came out negative and was left out (the grid does not resolve it)"
        )
    if notes["rejected"]:
        notes["warnings"].append(
            f"{len(notes['rejected'])} of {len(points)} points rejected as outliers (a noisy "
            f"host?): {', '.join(r['desc'] for r in notes['rejected'])}"
        )
    model = StepTimeModel(knots, list(coef[:k]), list(coef[k:]))
    model.notes = notes
    return model


def fit_errors(model: StepTimeModel, points: list[dict]) -> dict:
    """Relative errors of the model on `points`: median, p90 and max of |predicted/measured - 1|."""
    if not points:
        return {}
    errs = sorted(abs(model.predict(p["shape"]) / p["time_s"] - 1.0) for p in points)
    return {
        "points": len(errs),
        "median_abs_rel_error": statistics.median(errs),
        "p90_abs_rel_error": errs[min(len(errs) - 1, int(0.9 * len(errs)))],
        "max_abs_rel_error": errs[-1],
    }


@dataclass
class Profile:
    """A measured profile: where it was taken, the engine settings, the points and the fit."""

    meta: dict
    engine: dict  # EngineConfig fields that decide step times and capacity
    capacity: dict  # num_kv_blocks, max_model_len
    points: list[dict]
    held_out: list[dict]
    model: StepTimeModel
    serving: dict | None = None  # serving calibration (sim/calibrate.py), when measured
    # seconds a replica takes to load a LoRA adapter it does not hold, when measured (the
    # simulator's SimSettings.lora_load_s overrides it; neither: sim.cluster's placeholder)
    lora_load_s: float | None = None

    def as_dict(self) -> dict:
        def enc(ps):
            return [
                {
                    "tokens": p["shape"].tokens,
                    "causal_pairs": p["shape"].causal_pairs,
                    "prefix_pairs": p["shape"].prefix_pairs,
                    "decode_context": p["shape"].decode_context,
                    "requests": p["shape"].requests,
                    "prefill": p["prefill"],
                    "decode": p["decode"],
                    "time_s": p["time_s"],
                    "kind": p["kind"],
                    "desc": p["desc"],
                    "samples_s": p.get("samples_s", [p["time_s"]]),
                    "rejected": p.get("rejected", 0),
                }
                for p in ps
            ]

        return {
            "format": FORMAT_VERSION,
            "meta": self.meta,
            "engine": self.engine,
            "capacity": self.capacity,
            "model": self.model.as_dict(),
            "fit_error": fit_errors(self.model, self.points),
            "held_out_error": fit_errors(self.model, self.held_out),
            "serving": self.serving,
            "lora_load_s": self.lora_load_s,
            "points": enc(self.points),
            "held_out": enc(self.held_out),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if d.get("format") not in READABLE_FORMATS:
            raise ValueError(
                f"profile format {d.get('format')!r}, expected one of {READABLE_FORMATS}"
            )

        def dec(ps):
            return [
                {
                    # rebuilt from the raw step (a later model may weigh it differently)
                    "shape": shape_of_raw(p),
                    "prefill": p["prefill"],
                    "decode": p["decode"],
                    "time_s": p["time_s"],
                    "kind": p["kind"],
                    "desc": p["desc"],
                    "samples_s": p.get("samples_s", [p["time_s"]]),
                    "rejected": p.get("rejected", 0),
                }
                for p in ps
            ]

        return cls(
            d["meta"],
            d["engine"],
            d["capacity"],
            dec(d["points"]),
            dec(d["held_out"]),
            StepTimeModel.from_dict(d["model"]),
            upgrade_serving(d.get("serving")),
            d.get("lora_load_s"),
        )

    def warnings(self) -> list[str]:
        """Why this profile's prices may be off: taken on a busy host, a poor fit (on the grid
        or the held-out mixed steps), terms or serving coefficients the fit could not resolve."""
        out = []
        host = self.meta.get("host")
        if host is None:
            out.append("profile records no host load (format 3): re-profile on a quiet host")
        elif host.get("busy"):
            out.append(f"profile taken on a busy host: {host.get('busy_reason')}")
        grid = fit_errors(self.model, self.points)
        if grid and grid["median_abs_rel_error"] > POOR_FIT_MEDIAN:
            out.append(
                f"poor fit: median error {grid['median_abs_rel_error']:.1%} on the grid "
                f"(limit {POOR_FIT_MEDIAN:.0%})"
            )
        held = fit_errors(self.model, self.held_out)
        if held and held["median_abs_rel_error"] > POOR_HELD_OUT_MEDIAN:
            out.append(
                f"poor fit: median error {held['median_abs_rel_error']:.1%} on the held-out "
                f"mixed steps (limit {POOR_HELD_OUT_MEDIAN:.0%})"
            )
        out += self.model.notes.get("warnings", [])
        if self.serving:
            out += [f"serving calibration: {w}" for w in self.serving.get("warnings", [])]
        return out

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if not p.exists() and (PROFILES / f"{path}.json").exists():
            p = PROFILES / f"{path}.json"  # a shipped profile by name
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            shipped = sorted(x.stem for x in PROFILES.glob("*.json"))
            raise FileNotFoundError(
                f"no profile at {path} (shipped profiles: {', '.join(shipped) or 'none'})"
            ) from None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")


def upgrade_serving(serving: dict | None) -> dict | None:
    """A serving dict of any layout as SERVING_MODEL's: the interpolated per-batch overheads of
    layout 1 ({"batches", "extra_s", ...}) become the least-squares line through them."""
    if not serving or serving.get("model") == SERVING_MODEL:
        return serving
    xs = np.asarray(serving["batches"], dtype=float)
    ys = np.asarray(serving["extra_s"], dtype=float)
    if len(xs) >= 2:
        token_s, step_s = np.polyfit(xs, ys, 1)
    else:
        token_s, step_s = 0.0, float(ys[0])
    return {
        **{k: v for k, v in serving.items() if k not in ("batches", "extra_s")},
        "model": SERVING_MODEL,
        "step_s": float(step_s),
        "token_s": float(token_s),
        "prefill_scale": serving.get("prefill_scale", 1.0),
        "path_latency_s": serving.get("path_latency_s", 0.0),
        "path_rate_s": 0.0,
        "warnings": ["converted from an interpolated calibration (layout 1): recalibrate"],
    }


# -- measuring -----------------------------------------------------------------------------------
def raw_step(so) -> dict:
    """A scheduler output as plain data: its prefill chunks [[c, o], ...] and decode contexts."""
    prefill, decode = [], []
    for sched in so.scheduled:
        c, o = sched.num_tokens, sched.start
        if c == 1 and o >= sched.request.num_prompt_tokens:
            decode.append(o + 1)
        else:
            prefill.append([c, o])
    return {"prefill": prefill, "decode": decode}


def shape_of_raw(raw: dict) -> StepShape:
    return StepShape.of([tuple(x) for x in raw["prefill"]], list(raw["decode"]))


@dataclass
class Timing:
    """A grid point's timing: its robust median, the step the scheduler ran, every sample and
    how many of them were rejected as outliers."""

    time_s: float
    raw: dict
    samples_s: list[float]
    rejected: int


class _Prober:
    """Drives a real Engine into chosen step shapes and times `Engine.step`; each timing comes
    with the step the scheduler actually ran (`raw_step`), not the one asked for."""

    def __init__(self, engine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.vocab = min(engine.vocab_size, 30_000)
        self._n = 0
        self._last: dict | None = None
        engine.step_listeners.append(self._listen)

    def _listen(self, engine, so, outputs, step_time) -> None:
        self._last = raw_step(so)

    def close(self) -> None:
        self.engine.step_listeners.remove(self._listen)

    def _id(self) -> str:
        self._n += 1
        return f"p{self._n}"

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    def _params(self, max_tokens: int):
        from replica.request import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def _drain(self) -> None:
        e = self.engine
        e.abort([rid for rid in list(e.scheduler.requests)])
        e.step()  # lets the runner drop the aborted requests' state

    def _run_until_decoding(self, ids: list[str]) -> None:
        e = self.engine
        while any(e.scheduler.requests[r].num_output_tokens == 0 for r in ids):
            e.step()

    def _timed_step(self) -> tuple[float, dict]:
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0, self._last

    @staticmethod
    def _median(samples: list[tuple[float, dict]]) -> Timing:
        """The median time after rejecting outliers (robust_center), with the step of the
        sample at the middle and every sample."""
        times = [t for t, _ in samples]
        center, keep = robust_center(times)
        ordered = sorted(samples, key=lambda x: x[0])
        return Timing(center, ordered[len(ordered) // 2][1], times, keep.count(False))

    def decode(self, n: int, ctx: int, reps: int) -> Timing:
        """Median step time of n decodes at context ~ctx."""
        ids = []
        for _ in range(n):
            rid = self._id()
            self.engine.add_request(rid, self._tokens(ctx), self._params(reps + 8))
            ids.append(rid)
        self._run_until_decoding(ids)
        samples = [self._timed_step() for _ in range(reps)]
        self._drain()
        return self._median(samples)

    def prefill(self, c: int, o: int, reps: int, decodes: tuple[int, int] = (0, 0)) -> Timing:
        """Median time of a step that prefills c tokens after o cached ones (and runs
        `decodes` = (n, ctx) decodes beside it)."""
        samples = []
        block = self.engine.config.block_size
        for _ in range(reps):
            dec_ids = []
            for _ in range(decodes[0]):
                rid = self._id()
                self.engine.add_request(rid, self._tokens(decodes[1]), self._params(64))
                dec_ids.append(rid)
            self._run_until_decoding(dec_ids)
            prefix = self._tokens(o)
            if o:  # cache the prefix: a request with it (and one more token) runs to a token
                rid = self._id()
                self.engine.add_request(rid, prefix + self._tokens(1), self._params(1))
                while rid in self.engine.scheduler.requests:
                    self.engine.step()
                assert o % block == 0, "prefix lengths are whole blocks"
            rid = self._id()
            self.engine.add_request(rid, prefix + self._tokens(c), self._params(1))
            samples.append(self._timed_step())
            self._drain()
        return self._median(samples)


def kernel_switches(engine) -> list[int]:
    """Step sizes (tokens) at which the engine's matmuls change path: a quantized model
    de-quantizes + GEMMs from its crossover's rows on (replica/quant/crossover.py), a jump in
    cost that knots at both sides of it let the fit follow."""
    crossover = getattr(getattr(engine, "runner", None), "quant_crossover", None) or {}
    return sorted({int(m) for m in crossover.values() if int(m) > 1})


def _grid(
    config,
    max_model_len: int,
    capacity_tokens: int,
    quick: bool,
    budget_tokens: int,
    switches: list[int] = (),
):
    seqs = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= config.max_num_seqs]
    contexts = [c for c in (16, 128, 512, 1024, 2048) if c < max_model_len - 64]
    chunks = [c for c in (8, 32, 128, 256, 512, 1024, 2048) if c <= config.max_num_batched_tokens]
    offsets = [o for o in (0, 256, 1024) if o % config.block_size == 0]
    if quick:
        seqs = seqs[::2] + ([seqs[-1]] if len(seqs) % 2 == 0 else [])
        contexts = contexts[::2]
        chunks = chunks[::2]
        offsets = offsets[:2]
    # both sides of each kernel switch (not thinned by quick: the jump is what they measure)
    chunks = sorted(
        set(chunks)
        | {c for m in switches for c in (m - 1, m) if 0 < c <= config.max_num_batched_tokens}
    )
    decode = [
        (n, ctx)
        for n in seqs
        for ctx in contexts
        if n * (ctx + 16) <= min(capacity_tokens, budget_tokens)
    ]
    prefill = [
        (c, o)
        for c in chunks
        for o in offsets
        if c + o < max_model_len - 8 and c + o <= capacity_tokens // 2
    ]
    mixed = [
        (n, ctx, c)
        for n, ctx, c in ((4, 128, 128), (16, 256, 64), (32, 128, 256), (8, 512, 512))
        if n <= config.max_num_seqs
        and c <= config.max_num_batched_tokens - n
        and n * (ctx + 80) + c <= capacity_tokens // 2
        and ctx < max_model_len - 80
    ]
    return decode, prefill, mixed


def _point(timing: Timing, kind: str, desc: str) -> dict:
    return {
        "shape": shape_of_raw(timing.raw), "time_s": timing.time_s, "kind": kind, "desc": desc,
        "samples_s": timing.samples_s, "rejected": timing.rejected, **timing.raw,
    }  # fmt: skip


def measure(
    engine,
    quick: bool = False,
    reps: int = 7,
    seed: int = 0,
    max_setup_tokens: int = 32_768,
    progress=None,
) -> Profile:
    """Profile `engine` (a real `replica.engine.Engine`, prefix caching on) over the grid."""
    config = engine.config
    if not config.enable_prefix_caching:
        raise ValueError("profiling needs enable_prefix_caching (prefill chunks after a hit)")
    prober = _Prober(engine, random.Random(seed))
    capacity = engine.num_kv_blocks * config.block_size
    switches = kernel_switches(engine)
    decode, prefill, mixed = _grid(
        config, engine.max_model_len, capacity, quick, max_setup_tokens, switches
    )
    say = progress or (lambda msg: None)
    from sim.host import CpuTimes, cpu_identity, host_load

    start = CpuTimes.now()
    load_max = max(start.loadavg[0], 0.0)
    # warm-up: the first steps of each kind pay one-off costs (allocations, kernel caches)
    prober.decode(2, 16, 3)
    prober.prefill(32, 0, 2)
    points, held_out = [], []
    prefill_reps = max(3, reps // 2)  # at least 3: a median that can reject one outlier

    def note(timing: Timing, what: str) -> None:
        nonlocal load_max
        load_max = max(load_max, CpuTimes.now().loadavg[0])
        dropped = f"  ({timing.rejected} outliers)" if timing.rejected else ""
        say(f"{what} {timing.time_s * 1e3:8.2f} ms{dropped}")

    for n, ctx in decode:
        timing = prober.decode(n, ctx, reps)
        points.append(_point(timing, "decode", f"n={n} ctx={ctx}"))
        note(timing, f"decode n={n:<4d} ctx={ctx:<5d}")
    for c, o in prefill:
        timing = prober.prefill(c, o, prefill_reps)
        points.append(_point(timing, "prefill", f"c={c} o={o}"))
        note(timing, f"prefill c={c:<5d} o={o:<5d}")
    for n, ctx, c in mixed:
        timing = prober.prefill(c, 0, prefill_reps, decodes=(n, ctx))
        held_out.append(_point(timing, "mixed", f"n={n} ctx={ctx} c={c}"))
        note(timing, f"mixed n={n:<4d} ctx={ctx:<5d} c={c:<5d}")
    prober.close()
    model = fit(points)
    host = host_load(start, CpuTimes.now())
    host["loadavg_max"] = load_max

    meta = {
        "model": str(engine.model_dir),
        "model_name": Path(engine.model_dir).name,
        "machine": platform.machine(),
        **cpu_identity(),
        "host": host,
        "threads": _torch_threads(),
        "kernel_switches": switches,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": quick,
        "reps": reps,
    }
    engine_fields = {
        k: getattr(config, k)
        for k in (
            "dtype",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "long_prefill_token_threshold",
            "enable_chunked_prefill",
            "device",
        )
        if hasattr(config, k)
    }
    cap = {"num_kv_blocks": engine.num_kv_blocks, "max_model_len": engine.max_model_len}
    return Profile(meta, engine_fields, cap, points, held_out, model)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
