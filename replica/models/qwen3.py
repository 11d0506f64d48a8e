"""Qwen3 (per-head RMSNorm of queries and keys, head_dim set by the config) and Qwen3-MoE (the
same attention; sparse expert MLPs in the layers decoder_sparse_step and mlp_only_layers pick),
on the shared Llama decoder."""

from __future__ import annotations

from typing import Any

from torch import nn

from replica.layers.linear import TensorParallel
from replica.models.llama import LlamaForCausalLM, LlamaMLP
from replica.models.moe import num_experts_of, sparse_moe_block


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"

    @property
    def qkv_bias(self) -> bool:
        # Qwen3's attention_bias covers q, k, v and o (Qwen2 always had a QKV bias)
        return bool(getattr(self.hf_config, "attention_bias", False))


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    """Qwen3-MoE's rule: experts in every decoder_sparse_step-th layer, unless listed in
    mlp_only_layers."""
    num_experts = num_experts_of(hf_config)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    only_mlp = getattr(hf_config, "mlp_only_layers", None) or []
    return layer_index not in only_mlp and num_experts > 0 and (layer_index + 1) % step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def build_mlp(hf_config: Any, tp: TensorParallel, layer_index: int) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_index):
            return LlamaMLP(hf_config, tp)  # intermediate_size, as transformers builds it
        return sparse_moe_block(
            hf_config,
            tp,
            intermediate_size=hf_config.moe_intermediate_size,
            renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        )
