"""Rotary tables against transformers' own rotary modules, bit for bit: YaRN (its ramp, its
attention factor from factor / mscale / mscale_all_dim or given), LongRoPE in both regimes,
partial rotary, and the config reading that completes a scaling dict as transformers does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replica.layers.rotary import RotaryEmbedding, rope_parameters

MAX_POSITION = 256


def _hf_rotary(config, positions: torch.Tensor):
    """transformers' cos and sin [positions, rotary_dim] for this config (its model's rotary
    module, fp32)."""
    import transformers

    module = {
        "llama": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
        "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
        "phi3": transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding,
    }[config.model_type](config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(x, positions[None, :])
    return cos[0], sin[0]


def _ours(config) -> RotaryEmbedding:
    theta, scaling = rope_parameters(config)
    head_dim = config.hidden_size // config.num_attention_heads
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)


def _assert_tables_equal(ours: RotaryEmbedding, config, positions: torch.Tensor) -> None:
    cos, sin = _hf_rotary(config, positions)
    half = ours.rotary_dim // 2
    assert ours.cos.shape[1] == cos.shape[1] == ours.rotary_dim
    # bitwise: the same fp32 products as transformers; our sin is signed for the rotated half
    assert torch.equal(ours.cos[positions], cos)
    assert torch.equal(ours.sin[positions][:, half:], sin[:, half:])
    assert torch.equal(-ours.sin[positions][:, :half], sin[:, :half])


def _llama_config(rope: dict, **fields):
    from transformers import LlamaConfig

    base = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POSITION,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )
    return LlamaConfig(**(base | fields))


YARN_CASES = {
    "factor-only": {"factor": 4.0, "original_max_position_embeddings": 64},
    "given-attention-factor": {
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.3,
    },
    "mscale": {
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "betas-no-truncate": {
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_tables_equal_transformers(case):
    config = _llama_config({"rope_type": "yarn", **YARN_CASES[case]})
    ours = _ours(config)
    assert ours.rope_type == "yarn"
    if case != "given-attention-factor":
        assert ours.attention_factor != 1.0  # the factor is exercised, not trivially 1
    _assert_tables_equal(ours, config, torch.arange(MAX_POSITION))


def test_yarn_without_original_context_reads_max_position():
    """transformers fills original_max_position_embeddings from max_position_embeddings."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITION,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0},
    )
    ours = _ours(config)
    _assert_tables_equal(ours, config, torch.arange(MAX_POSITION))


def _phi3_config(partial: float = 1.0, **fields):
    from transformers import Phi3Config

    rotary_dim = int(16 * partial)
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(rotary_dim // 2)],
        "long_factor": [1.0 + 0.7 * i for i in range(rotary_dim // 2)],
    }
    base = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION,
        original_max_position_embeddings=32,
        partial_rotary_factor=partial,
        rope_scaling=rope,
    )
    return Phi3Config(**(base | fields))


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
def test_longrope_long_regime_equals_transformers_beyond_the_original_context(partial):
    """An engine serving past original_max_position_embeddings rotates with the long factors:
    transformers' tables for any sequence longer than the pretraining context."""
    config = _phi3_config(partial)
    ours = _ours(config)
    assert ours.rotary_dim == int(16 * partial) and ours.attention_factor > 1.0
    _assert_tables_equal(ours, config, torch.arange(40))  # 40 > 32: transformers' long regime
    _assert_tables_equal(ours, config, torch.arange(MAX_POSITION))


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_regime_when_the_engine_serves_no_more_than_the_original_context(partial):
    """max_model_len <= original_max_position_embeddings: the short factors, transformers'
    tables for every sequence within the pretraining context."""
    config = _phi3_config(partial)
    config.max_model_len = 32  # what a runner serving 32 tokens tells the model
    ours = _ours(config)
    _assert_tables_equal(ours, config, torch.arange(32))
    # and it is not the long regime's table
    config.max_model_len = None
    assert not torch.equal(_ours(config).cos[:32], ours.cos[:32])


def test_phi3_old_names_for_longrope_read_as_longrope():
    config = _phi3_config()
    for old in ("su", "yarn"):
        raw = SimpleNamespace(**{**config.to_dict(), "rope_parameters": None})
        raw.rope_scaling = {**config.rope_parameters, "rope_type": old}
        _, scaling = rope_parameters(raw)
        assert scaling["rope_type"] == "longrope"


def test_partial_rotary_default_rope_equals_transformers():
    from transformers import Phi3Config

    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION,
        partial_rotary_factor=0.75,
    )
    ours = _ours(config)
    assert (ours.rotary_dim, ours.rope_type) == (12, "default")
    _assert_tables_equal(ours, config, torch.arange(MAX_POSITION))


def test_partial_rotary_rotates_only_the_leading_dims():
    rotary = RotaryEmbedding(16, 64, 10000.0, {"partial_rotary_factor": 0.5})
    x = torch.randn(5, 3, 16)
    out = rotary.rotate(torch.arange(5) + 7, x)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.equal(out[..., :8], x[..., :8])


def test_unsupported_scalings_name_the_value_and_what_is_supported():
    with pytest.raises(ValueError, match="'dynamic' is not supported; supported: default.*yarn"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.1 gives 1 rotary dims"):
        RotaryEmbedding(16, 64, 10000.0, {"partial_rotary_factor": 0.1})
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 3,
        "long_factor": [1.0] * 3,
        "original_max_position_embeddings": 32,
        "max_model_len": 64,
        "factor": 2.0,
    }
    with pytest.raises(ValueError, match="long_factor has 3 entries; expected rotary_dim / 2 = 8"):
        RotaryEmbedding(16, 64, 10000.0, scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_kernel_equals_the_torch_rotation_bitwise(dtype):
    """rotate_ (the C kernel over each head's gathered rotary dims, in place in qkv rows)
    equals rotate; the value heads after the query and key heads are left alone."""
    from tests.replica.test_cpu_kernels import NATIVE_POSSIBLE

    if not NATIVE_POSSIBLE:
        pytest.skip("no native kernels on this host")
    rotary = RotaryEmbedding(16, 64, 10000.0, {"partial_rotary_factor": 0.75})
    qkv = torch.randn(9, 8 * 16).to(dtype)  # 4 query, 2 key, 2 value heads
    positions = torch.tensor([0, 3, 7, 8, 20, 33, 34, 50, 63])
    want = rotary.rotate(positions, qkv[:, : 6 * 16].view(9, 6, 16)).reshape(9, -1)
    got = qkv.clone()
    rotary.rotate_(positions, got, 6)
    assert torch.equal(got[:, : 6 * 16], want)
    assert torch.equal(got[:, 6 * 16 :], qkv[:, 6 * 16 :])
