"""Mixture-of-experts families on the shared Llama decoder: Mixtral (Mistral attention, every
layer sparse, experts named w1/w3/w2) and OLMoE (queries and keys normalised over the whole
projection, optional clip_qkv, every layer sparse). Qwen3-MoE is in qwen3.py."""

from __future__ import annotations

from typing import Any

from torch import nn

from replica.layers.linear import TensorParallel
from replica.layers.moe import SparseMoeBlock
from replica.models.llama import LlamaForCausalLM

_QKV_MAPPING = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
]


def num_experts_of(hf_config: Any) -> int:
    """config.json names it num_experts (Qwen3-MoE, OLMoE) or num_local_experts (Mixtral, and
    transformers' own save of Qwen3-MoE)."""
    for field in ("num_experts", "num_local_experts"):
        value = getattr(hf_config, field, None)
        if value is not None:
            return int(value)
    return 0


def sparse_moe_block(
    hf_config: Any,
    tp: TensorParallel,
    intermediate_size: int,
    renormalize: bool,
) -> SparseMoeBlock:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported for experts; supported: 'silu'")
    return SparseMoeBlock(
        hf_config.hidden_size,
        int(intermediate_size),
        num_experts_of(hf_config),
        int(hf_config.num_experts_per_tok),
        renormalize,
        tp,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    # the checkpoint's block_sparse_moe.experts.{e}.w1 / w3 / w2 are our
    # mlp.experts.{e}.gate_up_proj (parts 0 and 1) / down_proj
    checkpoint_renames = [("block_sparse_moe", "mlp")]
    stacked_params_mapping = _QKV_MAPPING + [
        ("gate_up_proj", "w1", 0),
        ("gate_up_proj", "w3", 1),
        ("down_proj", "w2", None),
    ]

    @staticmethod
    def build_mlp(hf_config: Any, tp: TensorParallel, layer_index: int) -> nn.Module:
        return sparse_moe_block(
            hf_config,
            tp,
            intermediate_size=hf_config.intermediate_size,
            renormalize=True,  # Mixtral rescales its top-k weights to sum to one
        )


class OlmoeForCausalLM(LlamaForCausalLM):
    qk_norm = "projection"

    @property
    def qkv_bias(self) -> bool:
        return bool(getattr(self.hf_config, "attention_bias", False))

    @staticmethod
    def build_mlp(hf_config: Any, tp: TensorParallel, layer_index: int) -> nn.Module:
        return sparse_moe_block(
            hf_config,
            tp,
            intermediate_size=hf_config.intermediate_size,
            renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        )
