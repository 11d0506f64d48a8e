"""Native CPU kernels: C sources in csrc/, compiled on first use with the system C compiler into
the stepserve cache (keyed by source, flags and CPU) and called through ctypes, which releases
the GIL for the call: paged decode attention and the fused elementwise steps of a decoder layer
(RMSNorm with the residual add, rotary, SiLU * up). One library per instruction-set level
(cpu_isa.py): the active level's is used, and a test can load any level the CPU runs. Without a
compiler (or when a build fails) `native_library()` is None and every caller uses its torch
path; the reason is logged once."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from replica.layers import cpu_isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# source -> its own extra compile flags. fused_ops.c without contraction: its rotary then
# rounds every product and sum as torch does (bitwise equal).
SOURCES = {  # the slowest to compile first: they build side by side
    # quant_gemm.c's int8 products, which include it: units of their own so they compile beside
    # the rest (the block-32 one takes ~25 s at -march=x86-64-v4 on a Zen 4)
    "quant_gemm_int8_b32.c": ("-fno-fast-math", "-ffp-contract=off"),
    "quant_gemm_int8_k.c": ("-fno-fast-math", "-ffp-contract=off"),
    "paged_decode.c": (),
    "paged_prefill.c": (),
    "fused_ops.c": ("-ffp-contract=off",),
    "threads.c": (),
    # without fast-math or contraction: its de-quantizer then rounds every product and sum as
    # gguf's numpy reference does (bitwise equal); its fast paths are intrinsics
    "quant_gemm.c": ("-fno-fast-math", "-ffp-contract=off"),
}
HEADERS = ("kv_elements.h", "vec_exp.h")  # included by the sources: part of the build's cache key
# -march comes from the instruction-set level (cpu_isa.march_flags): the AVX-512 paths compile
# at avx512 and above, the rest vectorize for the level's widest registers. -ffast-math lets the compiler vectorize the reductions and expf (libmvec). It is given to the
# compile step only: linking with it would add crtfastmath, whose constructor sets flush-to-zero
# for the whole process when the library loads, changing every float op of torch and Python.
CFLAGS = ("-O3", "-ffast-math", "-std=c11", "-fPIC")
LDFLAGS = ("-shared", "-pthread")
# OpenMP first: the kernels then run on torch's thread pool (libgomp.so.1 resolves to the copy
# torch has loaded); a compiler without it builds the pthread variant.
OPENMP = ("-fopenmp",)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
DISABLE_ENV = "STEPSERVE_NATIVE_KERNELS"  # "0": never build or use the native kernels

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # level -> library


def _cpu_signature() -> str:
    """The CPU's flags (cache key: a build is tuned for the CPU it was made on)."""
    return " ".join(sorted(cpu_isa.cpu_flags())) or platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, level: str) -> Path:
    march = cpu_isa.march_flags(level)
    try:
        return _build_with(compiler, OPENMP, march)
    except RuntimeError as exc:
        logger.info("OpenMP build failed (%s); building with pthreads", str(exc)[-300:])
        return _build_with(compiler, (), march)


def _build_with(compiler: str, extra: tuple[str, ...], march: tuple[str, ...]) -> Path:
    from replica.default_model import cache_root

    cflags, ldflags = CFLAGS + march + extra, LDFLAGS + extra
    parts = [_cpu_signature().encode(), " ".join(cflags + ldflags).encode()]
    for name, flags in SOURCES.items():
        parts += [name.encode(), " ".join(flags).encode(), (CSRC / name).read_bytes()]
    parts += [(CSRC / name).read_bytes() for name in HEADERS]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"stepserve_kernels-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: replicas starting together never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    objs = [f"{tmp[: -len('.so')]}-{i}.o" for i in range(len(SOURCES))]
    try:
        compiles = [
            [compiler, *cflags, *flags, "-c", str(CSRC / name), "-o", obj]
            for (name, flags), obj in zip(SOURCES.items(), objs)
        ]
        # the sources compile side by side (quant_gemm.c alone takes ~15 s), then link
        with ThreadPoolExecutor(
            max_workers=max(1, min(len(compiles), os.cpu_count() or 1))
        ) as pool:
            for _ in pool.map(_run_compiler, compiles):
                pass
        _run_compiler([compiler, *ldflags, *objs, "-o", tmp, "-lm"])
        os.replace(tmp, target)
    finally:
        for path in (tmp, *objs):
            if os.path.exists(path):
                os.unlink(path)
    logger.info("built native CPU kernels %s", target)
    return target


def _run_compiler(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")


def native_library(level: str | None = None) -> ctypes.CDLL | None:
    """The kernels' shared library built for `level` (None: the active level, cpu_isa), or
    None when native kernels are off or cannot be built here (the reason is logged once).
    Called per layer on the hot path: once decided, the answer is read without the lock."""
    if level is None:
        level = cpu_isa._thread.level or cpu_isa._process_level or cpu_isa.active_level()
    lib = _loaded.get(level, _MISSING)
    if lib is not _MISSING:
        return lib
    with _lock:
        if level in _loaded:
            return _loaded[level]
        lib = None
        if os.environ.get(DISABLE_ENV, "1") == "0":
            logger.info("native kernels off (%s=0): torch paths", DISABLE_ENV)
        elif (compiler := _compiler()) is None:
            logger.warning("no C compiler found (set CC): native CPU kernels off, torch paths")
        elif missing := cpu_isa.missing_flags(level):
            raise ValueError(
                f"native kernels for level {level!r} need {', '.join(missing)}, "
                "which this CPU lacks"
            )
        else:
            try:
                lib = ctypes.CDLL(str(_build(compiler, level)))
                _declare(lib)
            except Exception as exc:  # a broken toolchain must not take the engine down
                logger.warning("native CPU kernels unavailable (%s): torch paths", exc)
                lib = None
        _loaded[level] = lib
        return lib


_MISSING = object()


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        # ..., scale, bf16, num_threads, sliding window (0: none), soft cap (0: none)
        "stepserve_paged_decode": (ctypes.c_int, [ptr] * 6 + [i32] * 6 + [f32, i32, i32, i32, f32]),
        # q, its row stride, k/v caches, block table, q starts/lens, ctx starts, out, ...
        "stepserve_paged_prefill": (
            ctypes.c_int,
            [ptr, i64] + [ptr] * 7 + [i32] * 6 + [f32, i32, i32, i32, f32],
        ),
        "stepserve_rms_norm": (None, [ptr, ptr, ptr, ptr, i64, i32, f32, i32, i32]),
        "stepserve_silu_mul": (None, [ptr, ptr, i64, i32, i32, i32]),
        "stepserve_rotary": (None, [ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32]),
        "stepserve_set_thread_cpus": (ctypes.c_int, [ptr, i32, i32, i32]),
        # k, k row stride, v, v row stride, slots, k/v caches, rows, width, num_slots, elem,
        # num_threads
        "stepserve_kv_write": (
            ctypes.c_int,
            [ptr, i64, ptr, i64, ptr, ptr, ptr] + [i64] * 3 + [i32, i32],
        ),
        # qtype, w, ldw, n, k, x, ldx, m, y, ldy, bias, int8, num_threads
        "stepserve_quant_matmul": (
            ctypes.c_int,
            [i32, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, i32, i32],
        ),
        # qtype, w, ldw, n, k, ids, nrows, out, ldo, num_threads
        "stepserve_quant_dequantize": (
            ctypes.c_int,
            [i32, ptr, i64, i64, i64, ptr, i64, ptr, i64, i32],
        ),
        "stepserve_quant_isa": (ctypes.c_int, []),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


def set_thread_cpus(cpus: list[int], num_threads: int, pin: bool) -> int | None:
    """The CPUs of torch's OpenMP threads (a team of num_threads, the caller its thread 0): with
    pin, thread i runs on cpus[i] only; without, each may run on all of cpus. Returns how many
    threads took it, or None without the native library or in a build without OpenMP."""
    lib = native_library()
    if lib is None or not cpus or num_threads < 1 or (pin and len(cpus) < num_threads):
        return None
    array = (ctypes.c_int * len(cpus))(*cpus)
    done = lib.stepserve_set_thread_cpus(
        ctypes.cast(array, ctypes.c_void_p), len(cpus), num_threads, int(pin)
    )
    return None if done < 0 else int(done)


def paged_decode_kernel():
    """The paged decode C function, or None without the native library."""
    lib = native_library()
    return None if lib is None else lib.stepserve_paged_decode


def _check_attention_inputs(
    kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """What both attention kernels need of q [T, heads, d] and the caches [blocks, block_size,
    kv_heads, d]: the library, one fp32 or bf16 dtype, contiguous CPU caches, whole GQA groups."""
    if native_library() is None:
        raise RuntimeError(f"the native {kernel} kernel is not available")
    if q.dtype not in KERNEL_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"{kernel} takes fp32 or bf16 q and KV, got {q.dtype}/{k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence against its paged K/V, read in place.
    q [n, heads, d]; caches [blocks, block_size, kv_heads, d]; block_table int32 [n, max_blocks];
    seq_lens int32 [n]. Returns [n, heads, d] in q's dtype. sliding_window: only the last
    `window` keys are attended (earlier blocks are not read); soft_cap: scores capped by
    soft_cap * tanh(score / soft_cap) before the softmax."""
    _check_attention_inputs("paged_decode", q, k_cache, v_cache)
    q = q.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    num_seqs = q.shape[0]
    block_size = k_cache.shape[1]
    if block_table.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError("block_table and seq_lens need one row per query")
    if num_seqs and int(seq_lens.max()) > block_table.shape[1] * block_size:
        raise ValueError("a sequence is longer than its block table")
    _check_window_and_cap(sliding_window, soft_cap)
    return paged_decode_unchecked(
        q, k_cache, v_cache, block_table, seq_lens, scale, num_threads, sliding_window, soft_cap
    )


def _check_window_and_cap(sliding_window: int | None, soft_cap: float | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")


def paged_decode_unchecked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`paged_decode` for a caller that has checked its inputs (the native decode backend's
    metadata builder does, once per step, for all layers): contiguous caches of q's dtype, int32 contiguous block_table and
    seq_lens, every length within its table row. The kernel trusts these: a wrong length reads
    outside the cache."""
    fn = paged_decode_kernel()
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    status = fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_table.shape[1],
        float(scale),
        1 if q.dtype == torch.bfloat16 else 0,
        num_threads or torch.get_num_threads(),
        sliding_window or 0,
        float(soft_cap or 0.0),
    )
    if status:
        raise MemoryError("native paged decode kernel could not allocate its scratch memory")
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_starts: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each span's queries against its paged K/V (the span's own new K/V
    already written to the cache), read in place, tiled (csrc/paged_prefill.c). q [T, heads, d]
    holds the spans' query rows at q_starts[s]..q_starts[s]+q_lens[s]; their positions start at
    ctx_starts[s] and each attends keys 0..its position. Returns [T, heads, d] (rows outside
    the spans are left uninitialized). sliding_window and soft_cap as in `paged_decode`. Checks
    its inputs; `paged_prefill_unchecked` trusts them."""
    _check_attention_inputs("paged_prefill", q, k_cache, v_cache)
    q = q.contiguous()
    spans = [x.to(torch.int32).contiguous() for x in (q_starts, q_lens, ctx_starts)]
    block_table = block_table.to(torch.int32).contiguous()
    num_tokens = q.shape[0]
    block_size = k_cache.shape[1]
    n = block_table.shape[0]
    if any(x.shape != (n,) for x in spans):
        raise ValueError("q_starts, q_lens and ctx_starts need one entry per block_table row")
    starts, lens, ctx = (x.long() for x in spans)
    if n and (int(lens.min()) < 1 or int(starts.min()) < 0 or int(ctx.min()) < 0):
        raise ValueError("spans need q_lens >= 1 and non-negative starts")
    if n and int((starts + lens).max()) > num_tokens:
        raise ValueError("a span's query rows run past q")
    if n and int((ctx + lens).max()) > block_table.shape[1] * block_size:
        raise ValueError("a span's keys run past its block table")
    _check_window_and_cap(sliding_window, soft_cap)
    return paged_prefill_unchecked(
        q, k_cache, v_cache, block_table, *spans, scale, num_threads, None, sliding_window, soft_cap
    )


def paged_prefill_unchecked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_starts: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`paged_prefill` for a caller that checked its inputs once per step (the native backend's
    metadata builder): int32 contiguous tables, caches of one dtype, q [T, heads, d] whose heads
    are contiguous (its token rows may be strided: the query part of the qkv projection's rows
    is read in place). Writes the spans' rows of `out` (a new contiguous tensor when None)."""
    num_tokens, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    status = native_library().stepserve_paged_prefill(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        ctx_starts.data_ptr(),
        out.data_ptr(),
        block_table.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_table.shape[1],
        float(scale),
        1 if q.dtype == torch.bfloat16 else 0,
        num_threads or torch.get_num_threads(),
        sliding_window or 0,
        float(soft_cap or 0.0),
    )
    if status:
        raise MemoryError("native paged prefill kernel could not allocate its scratch memory")
    return out


# -- fused elementwise ops (fp32 and bf16 CPU) ---------------------------------------------------
MAX_NORM_WIDTH = 16384  # the norms widen a row on the stack


def fused_ops_available(x: torch.Tensor) -> bool:
    """Whether the fused C ops can take this activation: fp32 or bf16 on the CPU, with the
    library."""
    return x.dtype in KERNEL_DTYPES and x.device.type == "cpu" and native_library() is not None


def enable_fused_cpu_ops(model: torch.nn.Module) -> int:
    """Turn on the fused C ops in every module that has them (a `fused_cpu_ops` flag; each still
    checks its activation's dtype and device per call); returns how many modules."""
    count = 0
    for module in model.modules():
        if hasattr(module, "fused_cpu_ops"):
            module.fused_cpu_ops = True
            count += 1
    return count


def _rows(x: torch.Tensor, width: int, name: str, dtype: torch.dtype | None = None) -> int:
    if x.dtype not in KERNEL_DTYPES or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous fp32 or bf16 CPU tensor, got {x.dtype} {x.device}"
        )
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} is {x.dtype}, expected {dtype} like the input")
    if x.shape[-1] != width:
        raise ValueError(f"{name} has last dimension {x.shape[-1]}, expected {width}")
    return x.numel() // width


def _norm_width(x: torch.Tensor, weight: torch.Tensor) -> int:
    n = weight.shape[0]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rows of {n} exceed the fused norm's {MAX_NORM_WIDTH}")
    _rows(weight, n, "weight", x.dtype)
    return n


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension; with a residual, residual += x (in place)
    first and the residual is normalized instead."""
    n = _norm_width(x, weight)
    rows = _rows(x, n, "x")
    if residual is not None and _rows(residual, n, "residual", x.dtype) != rows:
        raise ValueError(f"x has {rows} rows, residual {residual.numel() // n}")
    out = torch.empty_like(x)
    native_library().stepserve_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        eps,
        x.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    inter = gate_up.shape[-1] // 2
    rows = _rows(gate_up, 2 * inter, "gate_up")
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    native_library().stepserve_silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        inter,
        gate_up.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
    return out


# below this many rows (decode steps) two index_copy_ calls cost what this call's checks and
# ctypes arguments cost (~7 us); at 128 / 512 rows they took 28 / 56 us against its 14 / 21
KV_WRITE_MIN_ROWS = 16


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """The step's new K and V rows ([T, kv_heads, d] each, rows may be strided: views of the
    qkv rows) into their cache slots (int64 [T]) of k_cache / v_cache ([num_blocks, block_size,
    kv_heads, d], contiguous, k's dtype) in one C call: what two `index_copy_` calls do. False,
    doing nothing, for fewer than KV_WRITE_MIN_ROWS rows or tensors that do not fit that shape
    (the caller copies instead); raises IndexError naming the slot range when a slot is outside
    the cache."""
    if k.shape[0] < KV_WRITE_MIN_ROWS or k.device.type != "cpu" or k.dtype not in KERNEL_DTYPES:
        return False
    if native_library() is None:
        return False
    width = k.shape[1] * k.shape[2]
    inner = (k.shape[2], 1)
    if (
        v.dtype != k.dtype
        or k_cache.dtype != k.dtype
        or v_cache.dtype != k.dtype
        or k.stride()[1:] != inner
        or v.stride()[1:] != inner
        or v.shape != k.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.shape != v_cache.shape
        or k_cache.shape[-2] * k_cache.shape[-1] != width
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or slot_mapping.shape != (k.shape[0],)
    ):
        return False
    num_slots = k_cache.numel() // width
    status = native_library().stepserve_kv_write(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k.shape[0], width, num_slots,
        k.element_size(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise IndexError(f"a KV slot is outside the cache's 0..{num_slots - 1}")
    return True


def rotary_(
    x: torch.Tensor,
    num_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate the first num_heads heads of every row of x [rows, >= num_heads * head_dim] in
    place (rows may be strided: a layer's query and key heads at the start of its qkv rows).
    cos/sin: fp32 tables [max_position, head_dim]; positions int64 [rows], each below
    max_position (the caller checks: RotaryEmbedding.rotate_ once per forward)."""
    if x.dtype not in KERNEL_DTYPES or x.device.type != "cpu" or x.stride(-1) != 1 or x.dim() != 2:
        raise ValueError("x must be a 2-D fp32 or bf16 CPU tensor with unit stride in its rows")
    if x.shape[1] < num_heads * head_dim or head_dim % 2:
        raise ValueError(f"x rows of {x.shape[1]} cannot hold {num_heads} heads of {head_dim}")
    if positions.dtype != torch.int64 or positions.shape != (x.shape[0],):
        raise ValueError("positions must be int64 with one entry per row")
    for t in (cos, sin):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[1] != head_dim:
            raise ValueError("cos/sin must be contiguous fp32 [max_position, head_dim] tables")
    positions = positions.contiguous()
    native_library().stepserve_rotary(
        x.data_ptr(),
        x.stride(0),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        x.shape[0],
        num_heads,
        head_dim,
        x.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
