"""Tiny random Gemma 2 / Gemma 3 (text) checkpoints, built with transformers' own config and
model classes and the project's tiny tokenizer (replica/tiny_models.py): sliding windows far
shorter than the test prompts and soft caps small enough that tanh bends the scores."""

from __future__ import annotations

from pathlib import Path

from replica.tiny_models import TINY_EOS_ID, TINY_VOCAB, save_checkpoint

GEMMA_FIELDS = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=TINY_EOS_ID,
    pad_token_id=0,
    query_pre_attn_scalar=24,  # not head_dim: the scale must come from it
)
ARCH_FIELDS = {
    "gemma2": dict(
        num_hidden_layers=4,  # local, global, local, global
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        rope_theta=10000.0,
    ),
    "gemma3": dict(
        num_hidden_layers=6,  # five local layers, then a global one
        sliding_window=12,
        final_logit_softcapping=4.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        },
    ),
}


def build_tiny_gemma(
    out_dir: Path, tokenizer_dir: Path, architecture: str, seed: int, **overrides
) -> None:
    """A random fp32 Gemma 2 ('gemma2') or Gemma 3 text ('gemma3') checkpoint; norm offsets
    random too, so loading them (as 1 + w) matters."""
    import torch
    import transformers

    classes = {
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }
    config_cls, model_cls = classes[architecture]
    fields = {**GEMMA_FIELDS, **ARCH_FIELDS[architecture], **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2 if "norm" in name else 0.1)
    save_checkpoint(model, out_dir, tokenizer_dir)
