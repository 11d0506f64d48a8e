"""Quantized weights inside the model: a linear layer's (or the token embedding's) `weight` is a
QuantizedWeight instead of an nn.Parameter when the model is built for a quantized checkpoint
(`building`). It holds no float copy: the layer's unchanged weight_loader narrows the checkpoint
tensor to this rank's rows and columns (a QuantizedTensor narrows by rows, or by whole blocks of
columns) and copies it into `weight.data.narrow(0, offset, n)`, which records a segment (its
first output row, the rows as they are). A fused projection's parts (q, k, v; gate, up) may
come in different types (a Q4_K_M file mixes Q4_K and Q6_K): each type keeps its own segment,
adjacent segments of one type are joined once loading ends (`finalize_weights`), and the matmul
runs one quantized matmul per segment into its output columns.

A float source (an F32/F16 tensor of a GGUF, or any tensor of a float checkpoint) stays a float
segment, or with `quantization="int8"` is quantized to Q8_0 as it is copied in (one layer's
weight at a time: the float model never exists whole). A weight whose segments all end up float
becomes an ordinary nn.Parameter again (finalize_weights)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replica.quant import kernels
from replica.quant.formats import (
    BLOCK,
    FLOAT_TYPES,
    QType,
    QuantFormatError,
    QuantizedTensor,
    quantize_q8_0,
)

logger = logging.getLogger(__name__)

Q8_GROUP = BLOCK[QType.Q8_0][0]
WEIGHT_KINDS = ("linear", "embedding", "lm_head")
Segment = tuple[int, "QuantizedTensor | torch.Tensor"]


_dequantized: set[tuple[str, str]] = set()


def _log_dequantized_once(device: torch.device, qtype: QType) -> None:
    key = (device.type, qtype.name)
    if key not in _dequantized:
        _dequantized.add(key)
        why = (
            "the quantized kernels run on CPU only"
            if device.type != "cpu"
            else f"the quantized kernels take {', '.join(sorted(t.name for t in kernels.NATIVE_QTYPES))}"
        )
        logger.warning(
            "%s tensors load de-quantized to the model's dtype on %s: %s",
            qtype.name,
            device.type,
            why,
        )


class QuantizedWeight:
    """This rank's [rows, cols] weight as segments of whole rows; duck-types what the layers'
    weight_loaders use of a parameter (`shape`, `data.narrow(0, ..).copy_(..)`, `data.zero_()`,
    `weight_loader`)."""

    def __init__(
        self,
        shape: tuple[int, int],
        weight_loader: Callable,
        kind: str,
        quantize_float: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"unknown weight kind {kind!r}")
        self.shape = torch.Size(shape)
        self.weight_loader = weight_loader
        self.kind = kind
        self.quantize_float = quantize_float  # float sources become Q8_0 (quantization="int8")
        self.device = torch.device(device)
        self.dtype = dtype  # of the model: float segments, looked-up rows
        self.activations = "int8"  # the quantized matmuls' activation mode (set by the runner)
        self.segments: list[Segment] = []
        self.name = ""  # the checkpoint name, for messages (set by the loader)

    # -- what the weight_loaders see ------------------------------------------------------
    @property
    def data(self) -> _Rows:
        return _Rows(self, 0, self.shape[0])

    @property
    def ndim(self) -> int:
        return 2

    def _put(self, offset: int, rows: int, src: Any) -> None:
        cols = self.shape[1]
        got = tuple(src.shape)
        if got != (rows, cols):
            raise QuantFormatError(
                f"{self.name or 'weight'}: rows [{offset}, {offset + rows}) of a [{self.shape[0]}, "
                f"{cols}] weight cannot take a tensor of shape {list(got)}"
            )
        if isinstance(src, QuantizedTensor) and (
            src.qtype in FLOAT_TYPES
            or self.device.type != "cpu"
            or src.qtype not in kernels.NATIVE_QTYPES
        ):
            # the quantized kernels are CPU kernels of NATIVE_QTYPES: other blocks, and any
            # off CPU, load de-quantized
            if src.qtype not in FLOAT_TYPES:
                _log_dequantized_once(self.device, src.qtype)
            src = src.dequantize()
        if isinstance(src, QuantizedTensor):
            segment = QuantizedTensor(src.qtype, src.shape, _owned(src.data, self.device))
        elif self.quantize_float and cols % Q8_GROUP == 0:
            q = quantize_q8_0(src.detach())
            segment = QuantizedTensor(q.qtype, q.shape, _owned(q.data, self.device))
        else:
            segment = _owned(src.detach().to(self.dtype), self.device)
        self.segments.append((offset, segment))

    # -- after loading --------------------------------------------------------------------
    def finalize(self) -> QuantizedWeight | nn.Parameter:
        """Join adjacent segments of one type; check they neither overlap nor, for a linear
        layer, leave rows out. An all-float weight comes back as a Parameter."""
        segments = sorted(self.segments, key=lambda s: s[0])
        joined: list[Segment] = []
        end = 0
        for offset, seg in segments:
            if offset < end:
                raise QuantFormatError(f"{self.name or 'weight'}: rows {offset}.. loaded twice")
            if joined and offset == end and _same_kind(joined[-1][1], seg):
                joined[-1] = (joined[-1][0], _cat(joined[-1][1], seg))
            else:
                joined.append((offset, seg))
            end = offset + seg.shape[0]
        covered = sum(seg.shape[0] for _, seg in joined)
        if self.kind == "linear" and covered != self.shape[0]:
            raise QuantFormatError(
                f"{self.name or 'weight'}: {covered} of its {self.shape[0]} rows were loaded"
            )
        self.segments = joined
        if all(isinstance(seg, torch.Tensor) for _, seg in joined):
            full = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            for offset, seg in joined:
                full[offset : offset + seg.shape[0]] = seg
            self.segments = []
            param = nn.Parameter(full, requires_grad=False)
            param.weight_loader = self.weight_loader
            return param
        return self

    @property
    def qtypes(self) -> list[str]:
        return [
            seg.qtype.name if isinstance(seg, QuantizedTensor) else str(seg.dtype).split(".")[-1]
            for _, seg in self.segments
        ]

    @property
    def quantized_bytes(self) -> int:
        return sum(s.nbytes for _, s in self.segments if isinstance(s, QuantizedTensor))

    @property
    def float_bytes(self) -> int:
        return sum(
            s.numel() * s.element_size() for _, s in self.segments if isinstance(s, torch.Tensor)
        )

    # -- compute --------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias), x [..., cols] -> [..., rows]; rows no segment holds (an embedding's
        padding past the vocabulary) are zero."""
        segments = self.segments
        if len(segments) == 1 and segments[0][1].shape[0] == self.shape[0]:
            return self._segment_matmul(x, segments[0][1], bias)
        out = x.new_zeros(*x.shape[:-1], self.shape[0])
        for offset, seg in segments:
            out[..., offset : offset + seg.shape[0]] = self._segment_matmul(x, seg, None)
        if bias is not None:
            out += bias
        return out

    def _segment_matmul(self, x, seg, bias) -> torch.Tensor:
        if isinstance(seg, QuantizedTensor):
            return kernels.quant_matmul(x, seg, bias, self.activations)
        return F.linear(x, seg, bias)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, each in [0, rows)) as [*ids.shape, cols] in the model's dtype:
        only the selected rows are de-quantized."""
        flat = ids.reshape(-1)
        out = torch.zeros(flat.numel(), self.shape[1], dtype=self.dtype, device=flat.device)
        for offset, seg in self.segments:
            n = seg.shape[0]
            if len(self.segments) == 1 and offset == 0:
                hit = flat < n
                where = None if bool(hit.all()) else hit.nonzero().squeeze(1)
            else:
                where = ((flat >= offset) & (flat < offset + n)).nonzero().squeeze(1)
            picked = flat - offset if where is None else flat.index_select(0, where) - offset
            if picked.numel() == 0:
                continue
            if isinstance(seg, QuantizedTensor):
                rows = kernels.dequantize(seg, picked).to(self.dtype)
            else:
                rows = seg.index_select(0, picked)
            if where is None:
                out = rows
            else:
                out.index_copy_(0, where, rows)
        return out.reshape(*ids.shape, self.shape[1])

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight({self.name or self.kind}, shape={list(self.shape)}, "
            f"segments={[(o, t) for (o, _), t in zip(self.segments, self.qtypes)]})"
        )


class _Rows:
    """weight.data, or a `narrow(0, ..)` of it: where a weight_loader copies one part."""

    def __init__(self, weight: QuantizedWeight, offset: int, rows: int) -> None:
        self.weight, self.offset, self.rows = weight, offset, rows

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.weight.shape[1]))

    def narrow(self, dim: int, start: int, length: int) -> _Rows:
        if dim != 0:
            raise QuantFormatError(
                f"{self.weight.name or 'a quantized weight'} can only be loaded by rows"
            )
        if start < 0 or start + length > self.rows:
            raise QuantFormatError(f"rows [{start}, {start + length}) out of {self.rows}")
        return _Rows(self.weight, self.offset + start, length)

    def copy_(self, src: Any) -> _Rows:
        self.weight._put(self.offset, self.rows, src)
        return self

    def zero_(self) -> _Rows:
        """Zero rows are rows no segment holds: forget the segments inside this span."""
        lo, hi = self.offset, self.offset + self.rows
        self.weight.segments = [
            (o, s) for o, s in self.weight.segments if o + s.shape[0] <= lo or o >= hi
        ]
        return self


def _owned(data: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy on `device` that shares no memory with the source (a memory-mapped
    file, a strided column slice)."""
    out = data.to(device)
    if out.data_ptr() == data.data_ptr() or not out.is_contiguous():
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def _same_kind(a, b) -> bool:
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return a.qtype == b.qtype
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)


def _cat(a, b):
    if isinstance(a, QuantizedTensor):
        data = torch.cat([a.data, b.data])
        return QuantizedTensor(a.qtype, (a.shape[0] + b.shape[0], a.shape[1]), data)
    return torch.cat([a, b])


# -- building a model with QuantizedWeights -----------------------------------------------
class WeightPlan:
    """Which weights a model being built holds quantized. mode "gguf": every linear and
    embedding weight (float tensors of the file become Parameters again after loading);
    quantize_float (quantization="int8"): float sources become Q8_0 as they load, for linear
    layers whose in-features are whole groups of 32, the LM head, and a tied embedding."""

    def __init__(self, gguf: bool, quantize_float: bool, tied_embeddings: bool) -> None:
        self.gguf, self.quantize_float, self.tied = gguf, quantize_float, tied_embeddings
        self.kept_float: list[tuple[int, ...]] = []

    def new_weight(self, shape, weight_loader, kind: str) -> QuantizedWeight | None:
        quantize = self.quantize_float
        if kind == "embedding" and not self.tied:
            quantize = False  # a lookup table: int8 quantizes it only as the tied LM head
        if quantize and shape[1] % Q8_GROUP:
            self.kept_float.append(tuple(shape))
            quantize = False
        if not (self.gguf or quantize):
            return None
        return QuantizedWeight(
            shape,
            weight_loader,
            kind,
            quantize,
            torch.get_default_device(),
            torch.get_default_dtype(),
        )


_PLAN: contextvars.ContextVar[WeightPlan | None] = contextvars.ContextVar("plan", default=None)


@contextlib.contextmanager
def building(plan: WeightPlan | None) -> Iterator[None]:
    """Layers built inside take their weights from `plan` (None: ordinary Parameters)."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)
    if plan is not None and plan.kept_float:
        logger.info(
            "int8: %d weights stay float (in-features not whole groups of %d): shapes %s",
            len(plan.kept_float),
            Q8_GROUP,
            sorted(set(plan.kept_float)),
        )


def new_weight(shape: tuple[int, ...], weight_loader: Callable, kind: str) -> Any:
    """A layer's weight: a QuantizedWeight when the model is being built for quantized weights
    and the plan takes this one, else an uninitialised Parameter with its loader."""
    plan = _PLAN.get()
    weight = None if plan is None else plan.new_weight(shape, weight_loader, kind)
    if weight is None:
        weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        weight.weight_loader = weight_loader
    return weight


# -- the model's quantized weights --------------------------------------------------------
def named_quantized_weights(model: nn.Module) -> Iterator[tuple[str, QuantizedWeight]]:
    """(name, weight) of each QuantizedWeight, once each (a tied LM head shares the
    embedding's: the first name wins, as named_parameters does)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        weight = module.__dict__.get("weight")
        if isinstance(weight, QuantizedWeight) and id(weight) not in seen:
            seen.add(id(weight))
            yield (f"{module_name}.weight" if module_name else "weight"), weight


def finalize_weights(model: nn.Module) -> None:
    """After loading: join each QuantizedWeight's segments; all-float ones become Parameters
    (every module holding a tied weight gets the same Parameter)."""
    replaced: dict[int, QuantizedWeight | nn.Parameter] = {}
    for _, weight in named_quantized_weights(model):
        replaced[id(weight)] = weight.finalize()
    for module in model.modules():
        weight = module.__dict__.get("weight")
        if isinstance(weight, QuantizedWeight):
            new = replaced[id(weight)]
            if new is not weight:
                del module.weight
                module.weight = new


def set_activations(model: nn.Module, mode: str) -> int:
    """Every quantized weight's matmuls take activations as `mode` ("int8" or "fp32");
    returns how many weights there are."""
    if mode not in kernels.ACTIVATIONS:
        raise ValueError(f"activations {mode!r}: expected one of {kernels.ACTIVATIONS}")
    count = 0
    for _, weight in named_quantized_weights(model):
        weight.activations = mode
        count += 1
    return count


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the weights: quantized blocks, float parameters (each once; a packed
    layer's oneDNN copy instead of its released row-major one) and float segments."""
    quantized = floats = layers = 0
    for _, weight in named_quantized_weights(model):
        quantized += weight.quantized_bytes
        floats += weight.float_bytes
        layers += 1
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            floats += param.numel() * param.element_size()
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, torch.Tensor) and id(packed) not in seen:
            seen.add(id(packed))
            # the weight's own bytes (an MKL buffer reserves more than it writes)
            floats += getattr(module, "packed_nbytes", 0) or packed.numel() * packed.element_size()
    return {
        "total_bytes": quantized + floats,
        "quantized_bytes": quantized,
        "float_bytes": floats,
        "quantized_weights": layers,
    }
