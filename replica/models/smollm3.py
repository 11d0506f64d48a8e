"""SmolLM3: the Llama decoder (models/llama.py) where every few layers attend without rotary
positions (NoPE). Which ones: config.no_rope_layers (1 = rotary, 0 = NoPE, one entry per
layer), or, without it, every no_rope_layer_interval-th layer."""

from __future__ import annotations

from typing import Any

import torch

from replica.layers.linear import TensorParallel
from replica.models.llama import LlamaForCausalLM


def rope_layers(hf_config: Any) -> list[bool]:
    """Whether each layer rotates its queries and keys."""
    layers = int(hf_config.num_hidden_layers)
    flags = getattr(hf_config, "no_rope_layers", None)
    if flags is None:
        interval = int(getattr(hf_config, "no_rope_layer_interval", 4))
        return [(i + 1) % interval != 0 for i in range(layers)]
    if len(flags) < layers:
        raise ValueError(
            f"no_rope_layers has {len(flags)} entries; expected one per layer "
            f"(num_hidden_layers={layers})"
        )
    return [bool(flag) for flag in flags[:layers]]


class NoRotary:
    """Stands in for the rotary embedding of a NoPE layer: positions leave q and k as they are
    (the attention layer's torch and fused paths both call it)."""

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        return None


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, tp: TensorParallel | None = None) -> None:
        super().__init__(hf_config, tp)
        no_rotary = NoRotary()
        for layer, rotates in zip(self.model.layers, rope_layers(hf_config), strict=True):
            if not rotates:
                # LlamaAttention reads its rotary from this one-tuple (shared, not registered)
                layer.self_attn._rotary = (no_rotary,)
