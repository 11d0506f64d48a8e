"""Rotary position embedding (rotate-half layout) with the scaling schemes of HF configs:
default, "linear" and "llama3"."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from replica.layers.cpu_kernels import rotary_

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a HF config, old (`rope_scaling`) or new
    (`rope_parameters`) style."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or params or None
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    return float(theta), (dict(scaling) if scaling else None)


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32; applied to q and k of shape
    [tokens, heads, head_dim]."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos().float(), freqs.sin().float()
        # full-width tables, sin signed for the rotated half: x * cos + swap_halves(x) * sin
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)
        self._step: tuple | None = None  # (positions, dtype, cos, sin) of the latest forward
        self._checked: torch.Tensor | None = None  # positions rotate_ last bounds-checked

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated by each token's position (any number of heads:
        a layer rotates its query and key heads in one call)."""
        cos, sin = self._tables(positions, x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        # the same products and sums as HF's q * cos + rotate_half(q) * sin, so fp32 is bitwise
        return x * cos + torch.cat((x2, x1), dim=-1) * sin

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        """The first num_heads heads of every row of x [tokens, >= num_heads * head_dim]
        rotated in place by the C kernel (CPU, fp32 or bf16; the same arithmetic as `rotate`)."""
        if self._checked is not positions:  # every layer of a forward passes the same tensor
            if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
                raise ValueError(
                    f"position {int(positions.max())} is beyond the rotary table of "
                    f"{self.cos.shape[0]} positions"
                )
            self._checked = positions
        rotary_(x, num_heads, self.head_dim, positions, self.cos, self.sin)

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        # every layer of one forward passes the same positions tensor: gather the rows once
        step = self._step
        if step is None or step[0] is not positions or step[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            self._step = step = (positions, dtype, cos, sin)
        return step[2], step[3]
