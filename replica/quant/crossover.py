"""From how many rows of x the de-quantize + GEMM path beats the quantized kernel (kernels.py),
chosen per host: timed at model load on the model's own weights, once per process, and kept on
disk per CPU model, kernel-library build, torch version and shapes, so that restarts and the
other replicas read it instead of timing again.

The crossover moves a lot between CPUs (512 rows for Q4_1 on an AMD EPYC Zen 4, where the int8
kernel is even with de-quantize + GEMM at 512; 32-64 on an Intel Xeon without AVX512_BF16,
where it is 2.5x behind at 512: docs/perf-quant.md), so a constant is wrong somewhere.

It is timed on one thread, in that thread's CPU time: a host busy with other work then costs
the timing nothing but repeats (wall-clock timings of a 2-thread team on a busy 2-core host
swing 2-3x, whichever path), and both paths split W's rows over the threads alike, so the
one-thread crossover holds for any thread count.

STEPSERVE_QUANT_CROSSOVER: unset or "auto" measures (cached); a row count applies to every type
and activation mode; "fixed" keeps kernels.CROSSOVER_M / CROSSOVER_M_KQUANTS, which are also
what a failed or skipped measurement falls back to."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from replica.cache import cache_root
from replica.layers import cpu_isa
from replica.quant import kernels
from replica.quant.formats import QType, QuantizedTensor

logger = logging.getLogger(__name__)

ENV = "STEPSERVE_QUANT_CROSSOVER"
# rows of x timed, per activation mode (the fp32-activation kernel loses to the GEMM early)
MEASURED_M = {"int8": (16, 32, 40, 48, 64, 96, 128, 256, 512), "fp32": (4, 8, 16, 32, 64, 128)}
REPEATS = 3  # per shape, path and M, interleaved; the minimum counts (a busy host only adds)
# A weight is timed on at most this many of its rows: both paths split W's rows, so their ratio
# holds, and a 49152-row LM head would cost seconds.
MAX_ROWS = 1024
# A type whose weights are smaller than this in all (elements of the timed rows) is not timed:
# its matmuls take microseconds whichever path runs, and timing them is mostly noise.
MIN_ELEMENTS = 1 << 18
LOCK_WAIT_S = 60.0  # for another process timing the same key, then time it here anyway
FORMAT = 1  # of the cache files: part of the key

# path ("kernel" or "dequant"), weight, rows of x -> seconds of one call (CPU time)
Timer = Callable[[str, QuantizedTensor, int], float]

# activations -> qtype -> the timed rows of each of the model's weight shapes of that type
_registered: dict[str, dict[QType, list[QuantizedTensor]]] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    return cache_root() / "quant-crossover"


def fallback(qtype: QType, activations: str) -> int:
    """The measured-once constants (AMD EPYC Zen 4, 2 threads)."""
    return kernels.builtin_crossover(qtype, activations)


def parse_env(value: str | None) -> int | str:
    """ENV's value: "auto" (also unset or empty), "fixed" or a row count >= 1."""
    text = (value or "auto").strip().lower()
    if text in ("auto", "fixed"):
        return text
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(
            f"{ENV}={value!r}: expected a row count >= 1, 'auto' (measure on this host) or "
            "'fixed' (the built-in constants)"
        )
    return rows


def choose(ms: list[int], kernel_s: list[float], dequant_s: list[float], fallback_m: int) -> int:
    """The smallest measured M (ascending `ms`) from which de-quantize + GEMM is faster at every
    larger measured M; where it is not faster at the largest, the kernel keeps every measured M:
    max(fallback_m, 2 * the largest)."""
    chosen = None
    for m, kernel, dequant in reversed(list(zip(ms, kernel_s, dequant_s))):
        if dequant >= kernel:
            break
        chosen = m
    return chosen if chosen is not None else max(fallback_m, 2 * ms[-1])


def measure(
    weights: list[QuantizedTensor], ms: list[int], timer: Timer, repeats: int = REPEATS
) -> tuple[list[int], list[float], list[float]]:
    """Seconds of the kernel and of de-quantize + GEMM for all `weights` together (one call
    each: a layer's worth), per M from the largest down; stops below the first M where the
    kernel wins (`choose` looks no lower). Returns the Ms measured (ascending) and both times.
    Each (weight, path, M) is the minimum of `repeats` calls, the two paths alternating."""
    done: list[tuple[int, float, float]] = []
    for m in sorted(ms, reverse=True):
        kernel = dequant = 0.0
        for w in weights:
            best = {"kernel": float("inf"), "dequant": float("inf")}
            for _ in range(repeats):
                for path in best:
                    best[path] = min(best[path], timer(path, w, m))
            kernel += best["kernel"]
            dequant += best["dequant"]
        done.append((m, kernel, dequant))
        if dequant >= kernel:
            break
    done.reverse()
    return [d[0] for d in done], [d[1] for d in done], [d[2] for d in done]


def native_timer(activations: str) -> Timer:
    """Times the real paths through the active native library (the caller's level) on the
    calling thread, in its CPU time (call under `one_thread`). No untimed first call: the
    minimum of the repeats drops the first one's page faults and scratch allocation."""
    lib = kernels._library()
    if lib is None:
        raise RuntimeError("the native quantized kernels are not available")
    int8 = activations == "int8"
    gen = torch.Generator().manual_seed(0)
    buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def timer(path: str, w: QuantizedTensor, m: int) -> float:
        n, k = w.shape
        key = (id(w), m)
        if key not in buffers:
            buffers[key] = (torch.randn(m, k, generator=gen), torch.empty(m, n))
        x, out = buffers[key]
        call = (
            (lambda: kernels._kernel(lib, x, w, out, None, int8))
            if path == "kernel"
            else (lambda: kernels._dequant_gemm(lib, x, w, out))
        )
        started = time.thread_time()
        call()
        return time.thread_time() - started

    return timer


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch (and so the kernels, which take torch's count) on the calling thread alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cache_key(qtype: QType, activations: str, weights: list[QuantizedTensor]) -> dict:
    """What a measurement depends on: CPU, the kernels' build (its file name holds the hash of
    sources, flags and CPU flags), torch (its GEMM), the type, mode and shapes."""
    lib = kernels._library()
    return {
        "format": FORMAT,
        "cpu": cpu_isa.cpu_model(),
        "kernels": Path(getattr(lib, "_name", "") or "none").name,
        "torch": torch.__version__,
        "threads": 1,
        "qtype": qtype.name,
        "activations": activations,
        "shapes": sorted(list(w.shape) for w in weights),
        "ms": list(MEASURED_M[activations]),
        "repeats": REPEATS,
    }


def _cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{key['qtype']}-{key['activations']}-{digest}.json"


def _read(path: Path) -> int | None:
    try:
        rows = json.loads(path.read_text())["crossover"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rows if isinstance(rows, int) and rows >= 1 else None


def _write(path: Path, record: dict) -> None:
    """Atomically (a reader never sees half a file)."""
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@contextlib.contextmanager
def _file_lock(directory: Path) -> Iterator[None]:
    """Held while one process times (replicas starting together then time once, and not while
    the others do); given up on after LOCK_WAIT_S, or without a writable cache directory."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / ".lock", "a")
    except OSError as exc:
        logger.warning("quantized matmul crossover not cached (%s)", exc)
        yield
        return
    with handle as f:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("%s busy for %.0f s: timing anyway", directory, LOCK_WAIT_S)
                    yield
                    return
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def crossover_for(
    qtype: QType,
    activations: str,
    weights: list[QuantizedTensor],
    timer: Timer | None = None,
) -> int:
    """The cached crossover for this key, else measured (and cached); the fallback constant if
    measuring fails. `timer`: the native one on one thread unless given."""
    key = cache_key(qtype, activations, weights)
    path = _cache_file(key)
    rows = _read(path)
    if rows is not None:
        return rows
    try:
        with _file_lock(path.parent):
            rows = _read(path)  # another process may have timed it meanwhile
            if rows is not None:
                return rows
            started = time.perf_counter()
            with contextlib.nullcontext() if timer else one_thread():
                ms, kernel_s, dequant_s = measure(
                    weights, list(MEASURED_M[activations]), timer or native_timer(activations)
                )
            rows = choose(ms, kernel_s, dequant_s, fallback(qtype, activations))
            took = time.perf_counter() - started
            record = {
                "crossover": rows,
                "ms": ms,
                "kernel_ms": [round(t * 1e3, 4) for t in kernel_s],
                "dequant_gemm_ms": [round(t * 1e3, 4) for t in dequant_s],
                "measured_s": round(took, 3),
                "key": key,
            }
            try:
                _write(path, record)
            except OSError as exc:  # used all the same, timed again by the next process
                logger.warning("quantized matmul crossover not cached (%s)", exc)
    except Exception as exc:  # a broken cache directory or kernel must not stop the engine
        rows = fallback(qtype, activations)
        logger.warning(
            "could not measure the %s/%s crossover (%s): %d rows (built-in)",
            qtype.name,
            activations,
            exc,
            rows,
        )
        return rows
    timings = ", ".join(
        f"M={m} {k * 1e3:.2f}/{d * 1e3:.2f}" for m, k, d in zip(ms, kernel_s, dequant_s)
    )
    logger.info(
        "quantized matmul crossover %s/%s: de-quantize + GEMM from %d rows (measured in %.2f s "
        "on one thread, kernel/de-quantize CPU ms: %s; cached in %s)",
        qtype.name,
        activations,
        rows,
        took,
        timings,
        path,
    )
    return rows


def table() -> dict[str, dict[QType, int]]:
    """kernels' table: activations -> qtype -> crossover rows, from ENV, the registered model's
    weights (cached or measured) and the fallback constants."""
    setting = parse_env(os.environ.get(ENV))
    out = kernels.builtin_crossovers()
    if isinstance(setting, int):
        out = {act: dict.fromkeys(by_type, setting) for act, by_type in out.items()}
    if setting != "auto" or kernels._library() is None:
        return out
    with _lock:
        for act, by_type in _registered.items():
            for qtype, weights in by_type.items():
                out[act][qtype] = crossover_for(qtype, act, weights)
    return out


def samples(model: nn.Module) -> dict[QType, list[QuantizedTensor]]:
    """Per native type, one weight per distinct shape among the model's quantized weights (at
    most MAX_ROWS of its rows, copied); types under MIN_ELEMENTS in all are left out."""
    found: dict[QType, dict[tuple[int, int], QuantizedTensor]] = {}
    for seg in _native_segments(model):
        rows = min(seg.shape[0], MAX_ROWS)
        shape = (rows, seg.shape[1])
        if shape not in found.setdefault(seg.qtype, {}):
            data = seg.data[:rows].clone()
            found[seg.qtype][shape] = QuantizedTensor(seg.qtype, shape, data)
    return {
        qtype: list(by_shape.values())
        for qtype, by_shape in found.items()
        if sum(r * c for r, c in by_shape) >= MIN_ELEMENTS
    }


def calibrate(model: nn.Module, activations: str) -> dict[str, int]:
    """At model load (in the runner's instruction-set scope): the model's weights become the
    ones timed for `activations` and the crossovers are chosen now (cached: a disk read after
    the first process). Returns {type name: rows} for the model's native types."""
    setting = parse_env(os.environ.get(ENV))  # a bad value fails the load, naming itself
    timed = samples(model)
    with _lock:
        _registered[activations] = timed
    kernels.reset_crossover()
    chosen = kernels.crossover_table()[activations]
    present = _model_types(model)
    result = {qtype.name: chosen[qtype] for qtype in sorted(present)}
    untimed = sorted(t.name for t in present if t not in timed) if setting == "auto" else []
    logger.info(
        "quantized matmul crossover (%s activations, %s=%s): de-quantize + GEMM from %s rows%s",
        activations,
        ENV,
        os.environ.get(ENV) or "auto",
        result,
        f" ({', '.join(untimed)}: small weights, built-in)" if untimed else "",
    )
    return result


def _native_segments(model: nn.Module) -> Iterator[QuantizedTensor]:
    """The model's quantized weight segments of the types the native kernels take."""
    from replica.quant.weights import named_quantized_weights

    for _, weight in named_quantized_weights(model):
        for _, seg in weight.segments:
            if isinstance(seg, QuantizedTensor) and seg.qtype in kernels.NATIVE_QTYPES:
                yield seg


def _model_types(model: nn.Module) -> set[QType]:
    return {seg.qtype for seg in _native_segments(model)}


kernels.set_crossover_source(table)  # kernels' table is this module's from now on
