"""The quantized block formats we keep weights in: GGML's (what a GGUF file holds), row-major,
one row of an [out, in] weight being `in / block` blocks back to back. `--quantization int8`
quantizes a float checkpoint into Q8_0 (int8 per group of 32 with an fp16 scale), so every
quantized weight is one of these types and one set of kernels serves both."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch


class QType(enum.IntEnum):
    """GGML type ids (gguf.GGMLQuantizationType values, also what the C kernels take)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# type -> (elements per block, bytes per block)
BLOCK = {
    QType.F32: (1, 4),
    QType.F16: (1, 2),
    QType.BF16: (1, 2),
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q5_0: (32, 22),
    QType.Q5_1: (32, 24),
    QType.Q8_0: (32, 34),
    QType.Q4_K: (256, 144),
    QType.Q5_K: (256, 176),
    QType.Q6_K: (256, 210),
}
FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})
QUANTIZED_TYPES = frozenset(BLOCK) - FLOAT_TYPES


class QuantFormatError(ValueError):
    """A tensor's type or shape does not fit a block format; the message names both."""


def qtype_of(value: int | str) -> QType:
    """The QType of a GGML type id or name; QuantFormatError naming the supported ones else."""
    try:
        return QType[value] if isinstance(value, str) else QType(int(value))
    except (KeyError, ValueError):
        supported = ", ".join(t.name for t in QType)
        raise QuantFormatError(
            f"GGML tensor type {value!r} is not supported (supported: {supported})"
        ) from None


def row_bytes(qtype: QType, cols: int) -> int:
    """Bytes of one row of `cols` elements; QuantFormatError when cols is not whole blocks."""
    elems, nbytes = BLOCK[qtype]
    if cols % elems:
        raise QuantFormatError(
            f"a {qtype.name} row holds whole blocks of {elems} elements; {cols} is not a multiple"
        )
    return cols // elems * nbytes


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D weight [rows, cols] held in `qtype` blocks: `data` is uint8 [rows, row_bytes].
    Rows (output channels) are whole in every format, so any row range is a valid tensor;
    columns split only at block boundaries (`narrow`)."""

    qtype: QType
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self) -> None:
        rows, cols = self.shape
        expected = (rows, row_bytes(self.qtype, cols))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise QuantFormatError(
                f"{self.qtype.name} tensor of shape {list(self.shape)} needs uint8 data of shape "
                f"{list(expected)}, got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def block_elems(self) -> int:
        return BLOCK[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def get_shape(self) -> list[int]:  # the lazy-slice protocol linear.py's loaders read
        return list(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows [start, start+length) (dim 0) or columns (dim 1, whole blocks only)."""
        rows, cols = self.shape
        if dim == 0:
            return QuantizedTensor(self.qtype, (length, cols), self.data[start : start + length])
        if dim not in (1, -1):
            raise QuantFormatError(f"a quantized tensor is 2-D; cannot narrow dim {dim}")
        elems, nbytes = BLOCK[self.qtype]
        if start % elems or length % elems:
            raise QuantFormatError(
                f"cannot split a {self.qtype.name} tensor of {cols} columns at [{start}, "
                f"{start + length}): shards must be whole blocks of {elems} columns"
            )
        b0, b1 = start // elems * nbytes, (start + length) // elems * nbytes
        return QuantizedTensor(self.qtype, (rows, length), self.data[:, b0:b1])

    def __getitem__(self, index) -> QuantizedTensor:
        """Slicing with at most one narrowed dimension (what narrow_loaded asks of a lazy
        checkpoint tensor); `[:]` is the tensor itself."""
        if not isinstance(index, tuple):
            index = (index,)
        out = self
        for dim, part in enumerate(index):
            if not isinstance(part, slice) or part.step not in (None, 1):
                raise QuantFormatError(f"unsupported index {index!r} on a quantized tensor")
            start, stop, _ = part.indices(self.shape[dim])
            if (start, stop) != (0, self.shape[dim]):
                out = out.narrow(dim, start, stop - start)
        return out

    def contiguous(self) -> QuantizedTensor:
        data = self.data.contiguous()
        return self if data is self.data else QuantizedTensor(self.qtype, self.shape, data)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols] through the gguf package's reference de-quantizer (the kernels'
        reference; the engine de-quantizes with kernels.dequantize)."""
        from gguf import quants

        if self.qtype in FLOAT_TYPES:
            dtype = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
            return self.data.contiguous().view(dtype[self.qtype]).float()
        out = quants.dequantize(self.data.contiguous().numpy(), self.qtype.value)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)


def quantize_q8_0(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 per group of 32 with an fp16 scale (GGML's Q8_0 layout): what
    `quantization="int8"` makes of each float linear weight at load."""
    rows, cols = weight.shape
    row_bytes(QType.Q8_0, cols)  # raises unless cols is whole groups
    w = weight.detach().float().reshape(rows, cols // 32, 32)
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    q = torch.where(scale > 0, w / torch.where(scale > 0, scale, 1.0), 0.0)
    q = q.round().clamp(-127, 127).to(torch.int8)
    d = scale.to(torch.float16)
    blocks = torch.cat([d.view(torch.uint8).reshape(rows, cols // 32, 2), q.view(torch.uint8)], -1)
    return QuantizedTensor(QType.Q8_0, (rows, cols), blocks.reshape(rows, -1).contiguous())
