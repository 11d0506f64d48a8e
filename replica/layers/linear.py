"""Megatron-style tensor-parallel linear layers whose parameters load their own shard from the
full Hugging Face tensor (`param.weight_loader`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers import cpu_gemm
from replica.quant.weights import QuantizedWeight, new_weight


@dataclass(frozen=True)
class TensorParallel:
    """Which shard this process holds and how shards talk; at size 1 no collective is called.

    `group` is a torch.distributed process group (None = the default group when size > 1).
    Collectives are methods so a test (or another backend) can supply its own.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape does not match what the model expects."""

    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        super().__init__(f"expected shape {expected}, checkpoint has {got}")
        self.expected = tuple(expected)
        self.got = tuple(got)


# A loaded tensor is either a full torch.Tensor or a lazy safetensors slice (get_slice), which
# reads only the rows/columns a rank asks for.
def loaded_shape(loaded: Any) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_loaded(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[..., start:start+length, ...] along `dim`, reading only that part from disk."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def full_loaded(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def check_shape(expected: tuple[int, ...], loaded: Any) -> None:
    got = loaded_shape(loaded)
    if tuple(expected) != got:
        raise WeightShapeError(tuple(expected), got)


def default_weight_loader(param: nn.Parameter, loaded: Any) -> None:
    """Replicated parameter: copy the whole tensor."""
    check_shape(tuple(param.shape), loaded)
    param.data.copy_(full_loaded(loaded))


def onednn_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run y = x W^T from a pre-packed W: a CPU build with mkldnn, and a
    dtype its matmul takes at the active instruction-set level (bf16 packing needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT: decided from the CPU's features, cpu_isa.py, not from a failed
    call)."""
    from replica.layers import cpu_isa

    return (
        weight.device.type == "cpu"
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and cpu_isa.onednn_bf16_packing())
        )
        and cpu_gemm._onednn_ops()
    )


# oneDNN streams a packed weight slower for 1 or 2 rows than for 4 (a model's linears: 17.5 /
# 20.5 / 14.2 ms at 1 / 2 / 4 rows, docs/perf-engine.md), so fewer rows are padded to this many.
MIN_PACKED_ROWS = 4


class PackableLinear(nn.Module):
    """A linear layer whose weight can be reordered once, after loading, into a blocked layout
    its CPU GEMM streams without re-packing per call: the skinny matmuls of decode and of a short
    prompt's prefill are bound by how fast the weights stream from memory (docs/perf-engine.md).
    fp32 weights go to MKL's packed sgemm on Intel CPUs where torch links MKL (cpu_gemm.py;
    0.74-0.96x the time of oneDNN's packed fp32 at 1-512 rows there), to oneDNN on other
    vendors' CPUs (MKL is up to 2.7x slower on AMD), bf16 ones to oneDNN, which uses AMX tiles
    or AVX512-BF16 where the CPU has them. `packing` records the path taken.
    Packing is one-way: the row-major weight is released."""

    packed_weight: torch.Tensor | None = None
    packing: str | None = None  # "mkl" or "onednn" once packed
    packed_nbytes = 0  # the bytes the packed copy holds (an MKL buffer reserves more, untouched)
    release_after_packing = True  # False where another module reads the same weight
    # the layer's LoRA adapters (replica/lora/layer.py LoRALinear), set when LoRA is on: their
    # products are added to the base output, before a row-parallel layer's all-reduce
    lora = None

    def pack_weights(self) -> bool:
        weight = self.weight
        if isinstance(weight, QuantizedWeight):  # quantized blocks: the quantized kernels
            return False
        if self.packed_weight is not None:
            return False
        packing = cpu_gemm.packing_for(weight)
        if packing is None:
            return False
        if packing == "mkl":
            self.packed_weight = cpu_gemm.mkl_pack(weight.detach())
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.packing = packing
        self.packed_nbytes = weight.numel() * weight.element_size()
        self.out_features = weight.shape[0]
        if self.release_after_packing:  # else the blocked copy would double the memory
            weight.data = weight.data.new_empty(0)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packing = self.packing
        if packing == "mkl":
            return cpu_gemm.mkl_linear(x, self.packed_weight, self.out_features, bias)
        if packing == "onednn":
            rows = x.shape[0]
            padded = rows < MIN_PACKED_ROWS  # zero rows added, their outputs dropped
            if padded:
                x = F.pad(x, (0, 0, 0, MIN_PACKED_ROWS - rows))
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
            return out[:rows] if padded else out
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.matmul(x, bias)
        return F.linear(x, self.weight, bias)


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every packable layer's weight for oneDNN (CPU only; a no-op elsewhere); returns how
    many layers were packed. Call once after the weights are loaded."""
    return sum(
        1
        for module in model.modules()
        if isinstance(module, PackableLinear) and module.pack_weights()
    )


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader
    return p


def _weight(shape: tuple[int, int], loader) -> nn.Parameter | QuantizedWeight:
    """A linear layer's weight: a Parameter, or a QuantizedWeight when the model is built for
    quantized weights (replica/quant/weights.py; its loader calls are the same)."""
    return new_weight(shape, loader, "linear")


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W split by output rows: each rank computes its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, tp.size, "output size")
        self.weight = _weight((self.output_size_per_rank, input_size), self.weight_loader)
        self.bias = _param((self.output_size_per_rank,), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        full = (self.output_size, *param.shape[1:])
        check_shape(full, loaded)
        n = self.output_size_per_rank
        param.data.copy_(narrow_loaded(loaded, 0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.apply(x, out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up:
    shard ids 0 and 1); each rank holds its slice of every part, parts back to back."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallel
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp)
        for size in output_sizes:
            divide(size, tp.size, "output size")

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        size = self.output_sizes[shard_id]
        check_shape((size, *param.shape[1:]), loaded)
        n = size // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, n).copy_(narrow_loaded(loaded, 0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projection (shard ids "q", "k", "v"). Query heads are split across ranks;
    KV heads too, or, when there are fewer KV heads than ranks, each rank keeps a replica of the
    one KV head its query heads attend to."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallel,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp.size, "number of attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "number of KV heads")
        else:
            divide(tp.size, num_kv_heads, "tensor_parallel_size over KV heads")
            self.num_kv_heads = 1
        nn.Module.__init__(self)
        self.tp = tp
        self.input_size = hidden_size
        self.output_size_per_rank = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.output_size = self.output_size_per_rank * tp.size
        self.weight = _weight((self.output_size_per_rank, hidden_size), self.weight_loader)
        self.bias = _param((self.output_size_per_rank,), self.weight_loader) if bias else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_head_start(self) -> int:
        """First global KV head this rank holds."""
        if self.total_num_kv_heads >= self.tp.size:
            return self.tp.rank * self.num_kv_heads
        return self.tp.rank * self.total_num_kv_heads // self.tp.size

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str) -> None:
        d = self.head_dim
        if shard_id == "q":
            total, count, offset = self.total_num_heads, self.num_heads, 0
            start = self.tp.rank * self.num_heads
        elif shard_id in ("k", "v"):
            total, count, start = self.total_num_kv_heads, self.num_kv_heads, self.kv_head_start()
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        else:
            raise ValueError(f"unknown QKV shard id {shard_id!r}")
        check_shape((total * d, *param.shape[1:]), loaded)
        param.data.narrow(0, offset, count * d).copy_(
            narrow_loaded(loaded, 0, start * d, count * d)
        )


class RowParallelLinear(PackableLinear):
    """y = x W^T + b with W split by input columns: each rank holds the matching slice of x
    (the output of a column-parallel layer); partial results are summed by all_reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, tp.size, "input size")
        self.weight = _weight((output_size, self.input_size_per_rank), self.weight_loader)
        # the bias is added once, after the reduction, so it is not counted tp times
        self.bias = _param((output_size,), default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        check_shape((self.output_size, self.input_size), loaded)
        n = self.input_size_per_rank
        param.data.copy_(narrow_loaded(loaded, 1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = self.matmul(x, self.bias)
            if self.lora is not None:
                self.lora.apply(x, out)
            return out
        partial = self.matmul(x, None)
        if self.lora is not None:  # this rank's share of the LoRA product, summed below
            self.lora.apply(x, partial)
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias
