"""Native CPU kernels: C sources in csrc/, compiled on first use with the system C compiler into
the stepserve cache (keyed by source, flags and CPU) and called through ctypes, which releases
the GIL for the call. Without a compiler (or when a build fails) `paged_decode_kernel()` is None
and attention uses its torch path; the reason is logged once."""

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
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.c"
# -march=native: the library is built for this CPU (the cache key includes its flags).
# -ffast-math lets the compiler vectorize the dot products' reductions and expf (libmvec). It is
# given to the compile step only: linking with it would add crtfastmath, whose constructor sets
# flush-to-zero for the whole process when the library loads, changing every float op of torch
# and Python alike.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c11", "-fPIC")
LDFLAGS = ("-shared", "-pthread")
# OpenMP first: the kernels then run on torch's thread pool (libgomp.so.1 resolves to the copy
# torch has loaded); a compiler without it builds the pthread variant.
OPENMP = ("-fopenmp",)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
DISABLE_ENV = "STEPSERVE_NATIVE_KERNELS"  # "0": never build or use the native kernels

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    try:
        return _build_with(compiler, OPENMP)
    except RuntimeError as exc:
        logger.info("OpenMP build failed (%s); building with pthreads", str(exc)[-300:])
        return _build_with(compiler, ())


def _build_with(compiler: str, extra: tuple[str, ...]) -> Path:
    from replica.default_model import cache_root

    cflags, ldflags = CFLAGS + extra, LDFLAGS + extra
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(cflags + ldflags).encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"paged_decode-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: replicas starting together never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for cmd in (
            [compiler, *cflags, "-c", str(SOURCE), "-o", obj],
            [compiler, *ldflags, obj, "-o", tmp, "-lm"],
        ):
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    logger.info("built native paged decode kernel %s", target)
    return target


def paged_decode_kernel():
    """The C function, or None when native kernels are off or cannot be built here."""
    with _lock:
        if "fn" in _loaded:
            return _loaded["fn"]
        fn = None
        if os.environ.get(DISABLE_ENV, "1") == "0":
            logger.info("native kernels off (%s=0): torch attention path", DISABLE_ENV)
        elif (compiler := _compiler()) is None:
            logger.warning("no C compiler found (set CC): CPU decode attention uses torch")
        else:
            try:
                lib = ctypes.CDLL(str(_build(compiler)))
                fn = lib.stepserve_paged_decode
                fn.restype = ctypes.c_int
                fn.argtypes = (
                    [ctypes.c_void_p] * 6
                    + [ctypes.c_int] * 6
                    + [
                        ctypes.c_float,
                        ctypes.c_int,
                        ctypes.c_int,
                    ]
                )
            except Exception as exc:  # a broken toolchain must not take the engine down
                logger.warning("native paged decode kernel unavailable (%s): torch path", exc)
                fn = None
        _loaded["fn"] = fn
        return fn


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence against its paged K/V, read in place.
    q [n, heads, d]; caches [blocks, block_size, kv_heads, d]; block_table int32 [n, max_blocks];
    seq_lens int32 [n]. Returns [n, heads, d] in q's dtype."""
    fn = paged_decode_kernel()
    if fn is None:
        raise RuntimeError("the native paged decode kernel is not available")
    if q.dtype not in KERNEL_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"paged_decode takes fp32 or bf16 q and KV, got {q.dtype}/{k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    q = q.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if block_table.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError("block_table and seq_lens need one row per query")
    if num_seqs and int(seq_lens.max()) > block_table.shape[1] * block_size:
        raise ValueError("a sequence is longer than its block table")
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
    )
    if status:
        raise MemoryError("native paged decode kernel could not allocate its scratch memory")
    return out
