"""RMSNorm, computed in fp32 like the reference implementation so low-precision runs match;
optionally fused with the residual add before it (one C pass on CPU activations)."""

from __future__ import annotations

import torch
from torch import nn

from replica.layers.cpu_kernels import MAX_NORM_WIDTH, fused_ops_available, rms_norm
from replica.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    fused_cpu_ops = False  # set by the runner: the C kernel for CPU activations

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(residual + x), residual + x), the sum written into
        `residual` in place on the fused path."""
        fused = (
            self.fused_cpu_ops
            and fused_ops_available(x)
            and self.weight.dtype == x.dtype
            and x.shape[-1] <= MAX_NORM_WIDTH
        )
        if residual is None:
            return rms_norm(x, self.weight, self.eps) if fused else self._norm(x)
        if fused:
            return rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
