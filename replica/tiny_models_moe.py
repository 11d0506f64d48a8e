"""Tiny random checkpoints of Qwen3, Qwen3-MoE, Mixtral and OLMoE, built with transformers' own
config and model classes and the project's tiny tokenizer (replica/tiny_models.py), for the
tests and bench/moe.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replica.tiny_models import TINY_EOS_ID, TINY_VOCAB, draw_weights, save_checkpoint

# transformers' (config class, model class) names by family
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
}

# the shapes the tests use: small, yet every family's particular path is exercised
TINY_FIELDS: dict[str, dict[str, Any]] = {
    # head_dim 32 is not hidden_size / heads (16); tied LM head
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    # sparse, dense (mlp_only_layers), sparse; top-2 of 8, renormalised; q/k/v/o biases
    "qwen3_moe": dict(
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        attention_bias=True,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    # top-3 of 8, not renormalised, q/k/v clamped
    "olmoe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        intermediate_size=48,
        clip_qkv=1.5,
        norm_topk_prob=False,
    ),
}


def build_tiny_family(
    out_dir: Path, tokenizer_dir: Path, family: str, seed: int, **overrides: Any
) -> None:
    """A random fp32 checkpoint (weights scaled up from HF's init so greedy choices have clear
    margins, norm weights around 1) in transformers' own save format."""
    import torch
    import transformers

    config_name, model_name = FAMILIES[family]
    fields: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=TINY_EOS_ID,
        pad_token_id=0,
    )
    fields.update(TINY_FIELDS[family])
    fields.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**fields)
    model = getattr(transformers, model_name)(config).float().eval()
    draw_weights(model)
    save_checkpoint(model, out_dir, tokenizer_dir)
