"""Which packed GEMM a CPU linear layer runs, and MKL's packed sgemm (cblas_sgemm_pack /
cblas_sgemm_compute, exported by torch's own libtorch_cpu where torch links MKL), called
through ctypes, which releases the GIL for the call.

fp32 weights: on Intel CPUs MKL's packed sgemm, 0.74-0.96x the time of oneDNN's packed fp32 for
a model's linear layers at 1-512 rows; on other vendors' oneDNN's (on an AMD EPYC MKL took
1.2-2.7x oneDNN's time, 2.2-2.7x at 16-32 rows: docs/perf-engine.md, "AMD EPYC (Zen 4)"), and
wherever torch has no MKL (aarch64, some builds). bf16 weights: oneDNN's packed bf16, which
runs on AMX tiles or AVX512-BF16 where the CPU has them, at the levels where oneDNN packs bf16
at all (cpu_isa.onednn_bf16_packing); below those they stay row-major (F.linear).
`STEPSERVE_CPU_GEMM` (`auto`, `mkl`, `onednn`) overrides the fp32 choice, for A/B runs; read
per packing call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GEMM_ENV = "STEPSERVE_CPU_GEMM"
GEMM_CHOICES = ("auto", "mkl", "onednn")
# the row count MKL is told to pack for: its layout does not limit the rows a call may have
# (any count gives the same results), and packing for 512 ran 1-512 rows as fast as packing for
# each count or faster (docs/perf-engine.md)
PACK_ROWS_HINT = 512
# cblas enums (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_warned: list[bool] = []


@lru_cache(maxsize=1)
def mkl_library() -> ctypes.CDLL | None:
    """torch's libtorch_cpu with MKL's packed sgemm declared, or None where it lacks it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    path = Path(torch.__file__).resolve().parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        size, pack, compute = (
            lib.cblas_sgemm_pack_get_size,
            lib.cblas_sgemm_pack,
            lib.cblas_sgemm_compute,
        )
    except (OSError, AttributeError) as exc:
        logger.info("MKL packed sgemm unavailable (%s): fp32 weights use oneDNN", exc)
        return None
    i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    size.restype, size.argtypes = ctypes.c_size_t, [i, i, i, i]
    pack.restype, pack.argtypes = None, [i, i, i, i, i, i, f, p, i, p]
    compute.restype, compute.argtypes = None, [i, i, i, i, i, i, p, i, p, i, f, p, i]
    return lib


def gemm_choice(environ: dict[str, str] | None = None) -> str:
    """STEPSERVE_CPU_GEMM as written (default auto); ValueError naming a bad value."""
    value = (os.environ if environ is None else environ).get(GEMM_ENV, "").strip().lower()
    if value and value not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV}={value!r} is not one of: {', '.join(GEMM_CHOICES)}")
    return value or "auto"


def fp32_packing() -> str | None:
    """The packed GEMM fp32 weights use here: "mkl", "onednn" or None (neither available)."""
    from replica.layers import cpu_isa

    return choose_fp32(
        gemm_choice(), cpu_isa.cpu_vendor(), mkl_library() is not None, _onednn_ops()
    )


def choose_fp32(choice: str, vendor: str, mkl: bool, onednn: bool) -> str | None:
    """`fp32_packing` from its inputs: the override, the CPU vendor and which libraries exist.
    auto: MKL on Intel CPUs, oneDNN on the others (MKL's kernels for them are not its fast
    ones), each falling back to the other where torch lacks it."""
    want = ("mkl" if vendor == "GenuineIntel" else "onednn") if choice == "auto" else choice
    if (want == "mkl" and mkl) or (want == "onednn" and onednn):
        return want
    if choice != "auto" and not _warned:
        _warned.append(True)  # once per process, not per layer
        logger.warning("%s=%s: torch has no such GEMM here, using the other", GEMM_ENV, choice)
    return "mkl" if mkl else "onednn" if onednn else None


def packing_for(weight: torch.Tensor) -> str | None:
    """How `weight` is packed at the active instruction-set level: "mkl", "onednn" or None
    (stays row-major: not on CPU, a dtype no packed GEMM takes here)."""
    from replica.layers import cpu_isa

    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.float32:
        return fp32_packing()
    if weight.dtype == torch.bfloat16 and cpu_isa.onednn_bf16_packing() and _onednn_ops():
        return "onednn"
    return None


def _onednn_ops() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def mkl_pack(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of an [out, in] fp32 weight (W^T as the B matrix), in a float buffer
    of the size MKL asks for (~2x the weight + 7 MB; it writes the weight's size of it, spread
    out: ~1.25x the weight resident)."""
    lib = mkl_library()
    n, k = weight.shape
    weight = weight.contiguous()
    nbytes = lib.cblas_sgemm_pack_get_size(_B_MATRIX, PACK_ROWS_HINT, n, k)
    buffer = torch.empty(-(-nbytes // 4), dtype=torch.float32)
    lib.cblas_sgemm_pack(
        _ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS_HINT, n, k, 1.0,
        weight.data_ptr(), k, buffer.data_ptr(),
    )  # fmt: skip
    return buffer


def mkl_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T (+ bias) from `mkl_pack`'s buffer; x [..., in] fp32. Called per linear layer per
    step: the 2-D contiguous input (every model's) takes no reshape."""
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows:
        mkl_library().cblas_sgemm_compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, rows, out_features, k,
            x2.data_ptr(), k, packed.data_ptr(), k, 0.0, out.data_ptr(), out_features,
        )  # fmt: skip
    if bias is not None:
        out.add_(bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
