"""Tiny random Phi-3 (LongRoPE, partial rotary, fused projections) and SmolLM3 (NoPE layers)
checkpoints, built with transformers' own config and model classes and the tiny tokenizer of
replica/tiny_models.py, for the parity tests of those families."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replica.tiny_models import TINY_EOS_ID, TINY_VOCAB, draw_weights, save_checkpoint

TINY_FIELDS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=TINY_EOS_ID,
    pad_token_id=0,
)


def longrope(rotary_dim: int, **fields: Any) -> dict[str, Any]:
    """A LongRoPE scaling dict with distinct, non-trivial short and long factors."""
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 1.5 * i for i in range(half)],
        **fields,
    }


def build_tiny_phi3(out_dir: Path, tokenizer_dir: Path, seed: int, **overrides: Any) -> None:
    import transformers

    config = transformers.Phi3Config(**(TINY_FIELDS | {"rms_norm_eps": 1e-5} | overrides))
    _save(transformers.Phi3ForCausalLM(config), out_dir, tokenizer_dir, seed)


def build_tiny_smollm3(out_dir: Path, tokenizer_dir: Path, seed: int, **overrides: Any) -> None:
    import transformers

    config = transformers.SmolLM3Config(**(TINY_FIELDS | {"num_hidden_layers": 4} | overrides))
    _save(transformers.SmolLM3ForCausalLM(config), out_dir, tokenizer_dir, seed)


def _save(model: Any, out_dir: Path, tokenizer_dir: Path, seed: int) -> None:
    """Weights drawn as build_tiny_model draws them (scaled up for clear greedy margins, norm
    weights around 1), saved in fp32 safetensors with the tokenizer beside them."""
    import torch

    torch.manual_seed(seed)
    model = model.float().eval()
    draw_weights(model)
    save_checkpoint(model, out_dir, tokenizer_dir)
