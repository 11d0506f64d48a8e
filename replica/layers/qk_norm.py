"""RMSNorm of the query and key projections, before rotary: per head (Qwen3: one weight of
head_dim shared by every head) or over the whole projection (OLMoE: one weight as wide as all
query, or all key, features; under tensor parallelism the mean square is summed across ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from replica.layers.linear import QKVParallelLinear, TensorParallel, check_shape, narrow_loaded
from replica.layers.norm import RMSNorm

QK_NORM_KINDS = ("head", "projection")


class HeadRMSNorm(RMSNorm):
    """RMSNorm over each head_dim-wide slice of x [tokens, heads * head_dim]."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__(head_dim, eps)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x is a strided slice of the qkv rows; the C op reads contiguous rows
        return super().forward(x.contiguous().view(-1, self.head_dim)).view(x.shape)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection whose features are split across ranks by heads: this
    rank holds `width` of `full_width` features, starting at `start`."""

    def __init__(
        self, width: int, full_width: int, start: int, eps: float, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.full_width, self.start, self.eps, self.tp = full_width, start, eps, tp
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        check_shape((self.full_width,), loaded)
        param.data.copy_(narrow_loaded(loaded, 0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        if self.tp.size == 1:
            variance = x.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.full_width
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(dtype)


def make_qk_norms(
    kind: str, qkv: QKVParallelLinear, eps: float, tp: TensorParallel
) -> tuple[nn.Module, nn.Module]:
    """(q_norm, k_norm) for this rank's share of the fused QKV projection."""
    d = qkv.head_dim
    if kind == "head":
        return HeadRMSNorm(d, eps), HeadRMSNorm(d, eps)
    if kind != "projection":
        raise ValueError(f"qk norm {kind!r} is not supported; supported: {QK_NORM_KINDS}")
    if qkv.total_num_kv_heads < tp.size:
        # each rank would hold a replica of a key head: its squares would be summed twice
        raise ValueError(
            f"a whole-projection key norm needs num_key_value_heads "
            f"({qkv.total_num_kv_heads}) >= tensor_parallel_size ({tp.size})"
        )
    q_norm = ProjectionRMSNorm(qkv.q_size, qkv.total_num_heads * d, tp.rank * qkv.q_size, eps, tp)
    k_norm = ProjectionRMSNorm(
        qkv.kv_size, qkv.total_num_kv_heads * d, qkv.kv_head_start() * d, eps, tp
    )
    return q_norm, k_norm
