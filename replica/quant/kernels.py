"""Matrix products with quantized weights kept in their GGML block layout (formats.py), through the
native kernels of replica/layers/csrc/quant_gemm.c (compiled per instruction-set level, like the
other CPU kernels: cpu_kernels.py).

`quant_matmul(x, w)` is y = x W^T with W [N, K] in blocks:
  - activations="int8" (the fast path): each row of x is quantized to int8 per block of 32 (Q4_0,
    Q4_1, Q8_0) or per super-block of 256 (Q4_K, Q5_K, Q6_K) and the products are integer dot
    products (AVX512-VNNI from the avx512_vnni level, AVX2/AVX-512BW maddubs below it);
  - activations="fp32" (the parity mode): weight blocks de-quantized in registers (exactly as
    gguf's reference rounds) and multiplied with fp32 x.
From a crossover number of rows of x (prefill, big decode batches) the weight is de-quantized to
fp32 in tiles and multiplied by torch's GEMM, which is faster there. The crossover is chosen per
host, type and activation mode (crossover.py: timed at model load, cached on disk;
docs/perf-quant.md); CROSSOVER_M / CROSSOVER_M_KQUANTS are the fallback.

Without the native library (no C compiler, STEPSERVE_NATIVE_KERNELS=0) both functions fall back
to the reference: QuantizedTensor.dequantize (gguf's numpy de-quantizer) and F.linear; logged
once. Float weights (F32/F16/BF16) are always de-quantized and multiplied by F.linear.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from replica.layers import cpu_kernels
from replica.quant.formats import FLOAT_TYPES, QType, QuantFormatError, QuantizedTensor

logger = logging.getLogger(__name__)

ACTIVATIONS = ("int8", "fp32")
# The fallback crossover (STEPSERVE_QUANT_CROSSOVER=fixed, small models, a failed measurement):
# from this many rows of x, de-quantizing the weight to fp32 (in tiles) and multiplying with
# torch's GEMM beats the quantized kernels on an AMD EPYC Zen 4, 2 threads, SmolLM2-135M shapes
# (docs/perf-quant.md). int8: Q4_1/Q8_0's kernel is 1.1-1.9x faster up to 256 rows and even at
# 512; the K-quants' 1.1-1.7x at 64, even (0.9-1.2x) at 128-512. fp32: the de-quantizing kernel
# is ahead at 4 rows, even at 16, 2-3x behind at 64. Other CPUs differ (2x on a Xeon).
CROSSOVER_M = {"int8": 512, "fp32": 16}
CROSSOVER_M_KQUANTS = {"int8": 256, "fp32": 16}
KQUANTS = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K})
# the block types quant_gemm.c multiplies by; a GGUF's other tensors load de-quantized
NATIVE_QTYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q8_0}) | KQUANTS
# the fp32 tile of a de-quantized weight (bytes): big enough for torch's GEMM to run at speed,
# small enough to stay in the caches between the de-quantizer and the GEMM
TILE_BYTES = 4 << 20

_ERRORS = {
    -1: "the kernel does not take this type or shape",
    -2: "could not allocate the kernel's scratch memory",
    -3: "a row id is out of range",
}
_logged_fallback = False
_scratch = threading.local()  # the reused fp32 tile of the de-quantize + GEMM path
# activations -> qtype -> the crossover rows (crossover.table: built at the first quantized
# matmul, and again when a runner calibrates for its model)
_crossover: dict[str, dict[QType, int]] = {}
_NO_TYPES: dict[QType, int] = {}


def _library():
    return cpu_kernels.native_library()


def native_available() -> bool:
    """Whether the native quantized kernels run here (else the reference path)."""
    return _library() is not None


def crossover_m(qtype: QType, activations: str) -> int:
    """From how many rows of x the de-quantize + GEMM path takes over from the kernel."""
    rows = crossover_table()[activations].get(qtype)
    if rows is None:  # a type the kernels do not take (they refuse it)
        return builtin_crossover(qtype, activations)
    return rows


def builtin_crossover(qtype: QType, activations: str) -> int:
    """The built-in constant (the fallback of a measured crossover)."""
    return (CROSSOVER_M_KQUANTS if qtype in KQUANTS else CROSSOVER_M)[activations]


def builtin_crossovers() -> dict[str, dict[QType, int]]:
    """activations -> qtype -> the built-in crossover constants."""
    return {act: {q: builtin_crossover(q, act) for q in NATIVE_QTYPES} for act in ACTIVATIONS}


# what builds the table: replica/quant/crossover.py registers its `table` when it is imported
# (it imports this module, not the reverse: no import cycle); until then the constants
_table_source: Callable[[], dict[str, dict[QType, int]]] = builtin_crossovers


def set_crossover_source(source: Callable[[], dict[str, dict[QType, int]]]) -> None:
    """The function that builds the crossover table from now on (the next use rebuilds it)."""
    global _table_source
    _table_source = source
    reset_crossover()


def crossover_table() -> dict[str, dict[QType, int]]:
    """activations -> qtype -> crossover rows (crossover.py's table once it is imported: the
    runner imports it), built on first use."""
    global _crossover
    if not _crossover:
        _crossover = _table_source()
    return _crossover


def reset_crossover() -> None:
    """Choose the crossovers again at the next use (a runner registered its model's weights)."""
    global _crossover
    _crossover = {}


def _fallback(reason: str) -> None:
    global _logged_fallback
    if not _logged_fallback:
        _logged_fallback = True
        logger.warning(
            "native quantized kernels unavailable (%s): de-quantizing to fp32 (gguf reference) "
            "and F.linear, slow",
            reason,
        )


def _weight_ptr(w: QuantizedTensor) -> tuple[torch.Tensor, int]:
    """w's bytes with unit stride within a row, and the row stride in bytes (a column slice of
    whole blocks keeps its parent's stride: no copy)."""
    data = w.data
    if data.device.type != "cpu":
        raise QuantFormatError("quantized weights must be on the CPU")
    if data.stride(-1) != 1 or (data.shape[0] > 1 and data.stride(0) < data.shape[1]):
        data = data.contiguous()
    return data, max(data.stride(0), data.shape[1])


def _check(status: int) -> None:
    if status:
        raise RuntimeError(f"native quantized kernel failed: {_ERRORS.get(status, status)}")


def _tile(rows: int, cols: int) -> torch.Tensor:
    """A reused fp32 scratch [rows, cols] (one per thread, grown as needed)."""
    need = rows * cols
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratch.buf = torch.empty(need)
    return buf[:need].view(rows, cols)


def _dequant_gemm(lib, x: torch.Tensor, w: QuantizedTensor, y: torch.Tensor) -> None:
    """y = x W^T with W de-quantized to fp32 a tile of rows at a time (torch's GEMM)."""
    n, k = w.shape
    data, ldw = _weight_ptr(w)
    rows = max(1, min(n, TILE_BYTES // (4 * k)))
    threads = torch.get_num_threads()
    for j0 in range(0, n, rows):
        j1 = min(n, j0 + rows)
        tile = _tile(j1 - j0, k)
        _check(
            lib.stepserve_quant_dequantize(
                int(w.qtype), data[j0].data_ptr(), ldw, j1 - j0, k, None, j1 - j0,
                tile.data_ptr(), k, threads,
            )
        )  # fmt: skip
        if j0 == 0 and j1 == n:
            torch.mm(x, tile.t(), out=y)
        else:
            y[:, j0:j1] = torch.mm(x, tile.t())


def quant_matmul_out(
    x: torch.Tensor,
    w: QuantizedTensor,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    activations: str = "int8",
) -> torch.Tensor:
    """out = x W^T (+ bias) for fp32 x [M, K] (unit stride in a row) into fp32 out [M, N] whose
    rows may be strided (a column slice of a wider output); returns out. Native kernels only."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native quantized kernels are not available")
    n, k = w.shape
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if w.qtype in FLOAT_TYPES:
        raise QuantFormatError(f"{w.qtype.name} weights take F.linear, not the quantized kernels")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be fp32 [M, {k}] with unit stride in its rows")
    m = x.shape[0]
    if out.dtype != torch.float32 or tuple(out.shape) != (m, n) or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be fp32 [{m}, {n}] with unit stride in its rows")
    if m >= crossover_m(w.qtype, activations) and out.is_contiguous():
        _dequant_gemm(lib, x, w, out)
        if bias is not None:
            out += bias
        return out
    _kernel(lib, x, w, out, bias, activations == "int8")
    return out


def _kernel(
    lib,
    x: torch.Tensor,
    w: QuantizedTensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    int8: bool,
) -> None:
    """The native kernel for any M (checked inputs: quant_matmul_out)."""
    (n, k), m = w.shape, x.shape[0]
    data, ldw = _weight_ptr(w)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    _check(
        lib.stepserve_quant_matmul(
            int(w.qtype), data.data_ptr(), ldw, n, k, x.data_ptr(), x.stride(0) if m > 1 else k,
            m, out.data_ptr(), out.stride(0) if m > 1 else n,
            None if bias is None else bias.data_ptr(), int8, torch.get_num_threads(),
        )
    )  # fmt: skip


def quant_matmul(
    x: torch.Tensor,
    w: QuantizedTensor,
    bias: torch.Tensor | None = None,
    activations: str = "int8",
) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] fp32 or bf16 (y: x's dtype, [..., N]); activations
    "int8" (quantized per block, integer products) or "fp32" (de-quantized weights)."""
    n, k = w.shape
    # decode's case in as few steps as Python allows (a call of a small model's linear layer
    # takes a few microseconds of kernel): 2-D contiguous fp32 x below the crossover
    lib = cpu_kernels.native_library()
    data = w.data
    qtype = w.qtype
    shape = x.shape
    if (
        lib is not None
        and x.dtype is torch.float32
        and len(shape) == 2
        and shape[1] == k
        and shape[0] < (_crossover or crossover_table()).get(activations, _NO_TYPES).get(qtype, 0)
        and qtype not in FLOAT_TYPES
        and x.is_cpu
        and x.is_contiguous()
        and data.is_contiguous()
        and (
            bias is None
            or (bias.dtype is torch.float32 and bias.is_contiguous() and bias.numel() == n)
        )
    ):
        m = shape[0]
        out = torch.empty(m, n)
        status = lib.stepserve_quant_matmul(
            qtype, data.data_ptr(), data.shape[1], n, k, x.data_ptr(), k, m, out.data_ptr(), n,
            None if bias is None else bias.data_ptr(), activations == "int8",
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            _check(status)
        return out
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if w.qtype in FLOAT_TYPES:
        return F.linear(x, w.dequantize().to(x.dtype), None if bias is None else bias.to(x.dtype))
    lib = _library()
    if lib is None or x.device.type != "cpu":
        _fallback("no native library" if lib is None else f"x on {x.device}")
        ref = F.linear(
            x.float(), w.dequantize().to(x.device), None if bias is None else bias.float()
        )
        return ref.to(x.dtype)
    x2 = x.reshape(-1, k)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have {n} elements, got {list(bias.shape)}")
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    quant_matmul_out(x2, w, out, bias, activations)
    out = out.view(*x.shape[:-1], n)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def dequantize(w: QuantizedTensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [len(rows) or N, K]: rows `rows` (int ids, e.g. token ids of an embedding lookup; any
    shape, the result is rows.shape + [K]) or all of W, exactly gguf's reference values."""
    n, k = w.shape
    if w.qtype in FLOAT_TYPES:
        full = w.dequantize()
        return full if rows is None else full[rows.long()]
    lib = _library()
    if lib is None:
        _fallback("no native library")
        if rows is None:
            return w.dequantize()
        ids = rows.reshape(-1).long()
        part = QuantizedTensor(w.qtype, (ids.numel(), k), w.data[ids])
        return part.dequantize().view(*rows.shape, k)
    data, ldw = _weight_ptr(w)
    ids = None if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
    count = n if ids is None else ids.numel()
    out = torch.empty(count, k, dtype=torch.float32)
    _check(
        lib.stepserve_quant_dequantize(
            int(w.qtype), data.data_ptr(), ldw, n, k, None if ids is None else ids.data_ptr(),
            count, out.data_ptr(), k, torch.get_num_threads(),
        )
    )  # fmt: skip
    return out if rows is None else out.view(*rows.shape, k)
