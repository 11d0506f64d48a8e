"""Rotary position embedding (rotate-half layout) with the scaling schemes of HF configs:
default, "linear", "llama3", "yarn" and "longrope", over all of a head or its first
`partial_rotary_factor` share (the rest passes through)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from replica.layers.cpu_kernels import rotary_

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# types whose pretraining context (original_max_position_embeddings) the scaling reads
_EXTENDING_TYPES = ("llama3", "yarn", "longrope")
# Phi-3's config class reads its older names for LongRoPE as "longrope"
_PHI3_LONGROPE_ALIASES = ("su", "yarn")


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a HF config, old (`rope_scaling`) or new
    (`rope_parameters`) style, completed as transformers' config classes complete it: the
    dict's rope_theta first, then the config's; partial_rotary_factor and, for the extending
    types, original_max_position_embeddings (the config's own field first) moved into it.
    A longrope dict also gets `max_model_len`, the longest context this engine serves (the
    config's max_model_len where the runner sets one, else max_position_embeddings): it picks
    the short or long factors once for every request (see `_longrope_factors`)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or params or None
    theta = (
        (scaling or {}).get("rope_theta")
        or params.get("rope_theta")
        or getattr(hf_config, "rope_theta", None)
        or 10000.0
    )
    if not scaling:
        partial = getattr(hf_config, "partial_rotary_factor", None)
        return float(theta), ({"partial_rotary_factor": partial} if partial else None)
    scaling = dict(scaling)
    kind = rope_type(scaling)
    if getattr(hf_config, "model_type", None) == "phi3" and kind in _PHI3_LONGROPE_ALIASES:
        scaling["rope_type"] = kind = "longrope"
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        scaling.setdefault("partial_rotary_factor", partial)
    if kind in _EXTENDING_TYPES:
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        scaling.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    if kind in ("yarn", "longrope") and scaling.get("factor") is None:
        # both read the stretch as the ratio of the two contexts when the config has none
        scaling["factor"] = (
            hf_config.max_position_embeddings / scaling["original_max_position_embeddings"]
        )
    if kind == "longrope":
        served = getattr(hf_config, "max_model_len", None) or hf_config.max_position_embeddings
        scaling["max_model_len"] = int(served)
    return float(theta), scaling


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def rotary_dim_of(head_dim: int, scaling: dict[str, Any] | None) -> int:
    """How many leading dims of a head rotate (transformers truncates head_dim * factor)."""
    factor = float((scaling or {}).get("partial_rotary_factor") or 1.0)
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {dim} rotary dims of a {head_dim}-dim head; "
            "supported: an even number of dims between 2 and head_dim"
        )
    return dim


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    kind = rope_type(scaling)
    if kind == "longrope":
        return 1.0 / (_longrope_factors(scaling, rotary_dim) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inverse_frequencies(rotary_dim, theta, scaling)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (so q.k scales by its square);
    1 for the other types."""
    kind = rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    if kind == "longrope":
        if factor <= 1.0:
            return 1.0
        original = float(scaling["original_max_position_embeddings"])
        return math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    # YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 when the context is stretched
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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


def _yarn_inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): dims that turn more than beta_fast times over the pretraining
    context keep their frequency, those turning fewer than beta_slow times are slowed by
    `factor`, and a linear ramp over dim indices blends the two between."""
    factor = float(scaling["factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:
        # the dim index whose wavelength fits `turns` times into the pretraining context
        return dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the original frequency is kept (extrapolation)
    base_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    kept, slowed = 1.0 / base_freqs, 1.0 / (factor * base_freqs)
    return slowed * (1 - keep) + kept * keep


def _longrope_factors(scaling: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """The per-frequency stretch of LongRoPE: short_factor within the pretraining context,
    long_factor beyond it. transformers picks by the current sequence length and, when a
    sequence crosses the pretraining context mid-generation, recomputes its whole cache with
    the long factors. A paged cache keeps each key as it was rotated, and shares prefix
    blocks between requests, so the choice here is made once per engine, by the longest
    context it serves: short when no request can outgrow the pretraining context (each
    request then matches transformers exactly), long otherwise (exact for every request
    longer than the pretraining context from its prompt on; shorter ones are rotated with
    the long factors where transformers would use the short)."""
    long = int(scaling["max_model_len"]) > int(scaling["original_max_position_embeddings"])
    name = "long_factor" if long else "short_factor"
    factors = torch.tensor(scaling[name], dtype=torch.float32)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(
            f"rope_scaling {name} has {factors.numel()} entries; expected rotary_dim / 2 = "
            f"{rotary_dim // 2}"
        )
    return factors


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32; applied to q and k of shape
    [tokens, heads, head_dim]. With partial rotary only the first rotary_dim dims of each
    head rotate."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, scaling)
        self.rope_type = rope_type(scaling)
        inv_freq = inverse_frequencies(self.rotary_dim, theta, scaling)
        self.attention_factor = attention_factor(scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos().float(), freqs.sin().float()
        if self.attention_factor != 1.0:  # as transformers scales its cos/sin (fp32)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # full-width tables, sin signed for the rotated half: x * cos + swap_halves(x) * sin
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)
        self._step: tuple | None = None  # (positions, dtype, cos, sin) of the latest forward
        self._checked: torch.Tensor | None = None  # positions rotate_ last bounds-checked
        self._repeated: tuple | None = None  # (positions, heads, positions per head row)

    @property
    def partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated by each token's position (any number of heads:
        a layer rotates its query and key heads in one call)."""
        cos, sin = self._tables(positions, x.dtype)
        if self.partial:
            rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
            return torch.cat((self._rotate_full(rot, cos, sin), rest), dim=-1)
        return self._rotate_full(x, cos, sin)

    @staticmethod
    def _rotate_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
        if not self.partial:
            rotary_(x, num_heads, self.head_dim, positions, self.cos, self.sin)
            return
        # The kernel rotates whole heads laid side by side; here each head's rotary part is
        # gathered into rows of its own (one row per token and head), rotated, written back.
        heads = x[:, : num_heads * self.head_dim].view(x.shape[0], num_heads, self.head_dim)
        rot = heads[..., : self.rotary_dim].reshape(-1, self.rotary_dim)
        rotary_(rot, 1, self.rotary_dim, self._per_head(positions, num_heads), self.cos, self.sin)
        heads[..., : self.rotary_dim] = rot.view(x.shape[0], num_heads, self.rotary_dim)

    def _per_head(self, positions: torch.Tensor, num_heads: int) -> torch.Tensor:
        cached = self._repeated
        if cached is None or cached[0] is not positions or cached[1] != num_heads:
            cached = (positions, num_heads, positions.repeat_interleave(num_heads))
            self._repeated = cached
        return cached[2]

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        # every layer of one forward passes the same positions tensor: gather the rows once
        step = self._step
        if step is None or step[0] is not positions or step[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            self._step = step = (positions, dtype, cos, sin)
        return step[2], step[3]
