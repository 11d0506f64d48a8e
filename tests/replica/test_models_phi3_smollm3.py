"""Phi-3 / Phi-4-mini (fused checkpoint projections, LongRoPE in both regimes, partial rotary,
tied head), SmolLM3 (NoPE layers) and a YaRN-scaled Qwen2: greedy fp32 through the engine is
token-identical to transformers across batching, chunked prefill, prefix caching, preemption,
the plain torch path and tensor-parallel shards; their config.json reads as transformers'
config classes read it."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
import torch

from replica.tiny_models import build_tiny_model
from replica.tiny_models_phi3_smollm3 import build_tiny_phi3, build_tiny_smollm3, longrope
from tests.replica.test_cpu_kernels import NATIVE_POSSIBLE
from tests.replica.test_model_parity import (
    MAX_TOKENS,
    PROMPT_LENGTHS,
    _hf_model,
    _sharded_logits,
    greedy_params,
    mixed_prompts,
)

ORIGINAL_CONTEXT = 32  # the long-regime checkpoints' original_max_position_embeddings


def _build(tmp_path_factory, tiny_tokenizer_dir, name: str) -> Path:
    out = tmp_path_factory.mktemp(name)
    if name == "phi3-long":  # Phi-3.5-mini-like: full rotary, untied head, serves past 32
        rope = longrope(16)
        build_tiny_phi3(out, tiny_tokenizer_dir, 21, original_max_position_embeddings=32,
                        rope_scaling=rope, tie_word_embeddings=False)  # fmt: skip
    elif name == "phi4-long":  # Phi-4-mini-like: 3/4 of each head rotates, tied head
        rope = longrope(12)
        build_tiny_phi3(out, tiny_tokenizer_dir, 22, original_max_position_embeddings=32,
                        partial_rotary_factor=0.75, rope_scaling=rope,
                        tie_word_embeddings=True)  # fmt: skip
    elif name == "phi4-short":  # serves no more than its pretraining context of 64
        rope = longrope(12, factor=8.0)  # the attention factor of a context stretched 8x
        build_tiny_phi3(out, tiny_tokenizer_dir, 23, max_position_embeddings=64,
                        original_max_position_embeddings=64, partial_rotary_factor=0.75,
                        rope_scaling=rope, tie_word_embeddings=True)  # fmt: skip
    elif name == "smollm3":  # NoPE in layers 1 and 3, rope_theta of its own
        build_tiny_smollm3(out, tiny_tokenizer_dir, 24, no_rope_layers=[1, 0, 1, 0],
                           rope_parameters={"rope_type": "default", "rope_theta": 5e5})  # fmt: skip
    elif name == "qwen2-yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 64}  # fmt: skip
        build_tiny_model(out, tiny_tokenizer_dir, "qwen2", seed=25, rope_parameters=rope,
                         max_position_embeddings=256)  # fmt: skip
    return out


@functools.cache
def _hf_greedy(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, through EOS (eos_token_id=[]: transformers 5 reads
    None as "the model's own" and would stop there) like the engine's ignore_eos requests."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _hf_model(model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
    return out[0, len(prompt) :].tolist()


def expected_outputs(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]):
    return [_hf_greedy(model_dir, tuple(p), n) for p, n in zip(prompts, max_tokens)]


FAMILIES = ["phi3-long", "phi4-long", "phi4-short", "smollm3", "qwen2-yarn"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {}


@pytest.fixture(params=FAMILIES)
def family(request, family_dirs, tmp_path_factory, tiny_tokenizer_dir) -> tuple[str, Path]:
    name = request.param
    if name not in family_dirs:
        family_dirs[name] = _build(tmp_path_factory, tiny_tokenizer_dir, name)
    return name, family_dirs[name]


def workload(name: str, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and token counts in the regime each checkpoint is exact in: past the original
    context from the prompt on for the long-regime LongRoPE ones, within 64 tokens in all
    for the short one (prompts 33-47 tokens and up to 13 new fit both); any for the rest."""
    if name.startswith("phi"):
        rng = random.Random(seed)
        lengths = [rng.randrange(ORIGINAL_CONTEXT + 1, 48) for _ in range(8)]
        return mixed_prompts(seed, lengths), [rng.randrange(6, 14) for _ in lengths]
    return mixed_prompts(seed, PROMPT_LENGTHS), MAX_TOKENS


@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_greedy_batch_matches_transformers(family, run_generation, max_num_batched_tokens):
    """The defaults: native attention, fused C ops (the rotary kernel, partial included) and
    packed weights where this CPU has them."""
    name, model_dir = family
    prompts, max_tokens = workload(name, 0)
    run = run_generation(
        model_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert run.runner.num_fused_modules > 0 or not NATIVE_POSSIBLE
    assert run.outputs == expected_outputs(model_dir, prompts, max_tokens)


def test_plain_torch_path_matches_transformers(family, run_generation):
    name, model_dir = family
    prompts, max_tokens = workload(name, 1)
    run = run_generation(
        model_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=4,
        max_num_batched_tokens=64,
        pack_cpu_weights=False,
        cpu_decode_attention="torch",
        cpu_prefill_attention="torch",
        cpu_fused_ops=False,
    )
    assert run.runner.num_fused_modules == 0 and not run.runner.native_decode
    assert run.outputs == expected_outputs(model_dir, prompts, max_tokens)


def test_shared_prefixes_in_chunks_match_transformers(family, run_generation):
    """Prefix-cache hits (a prefill starts after cached blocks) and 24-token chunks."""
    name, model_dir = family
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(34)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 6, 12)]
    prompts.append(shared[:33])
    max_tokens = [9, 6, 11, 8]
    run = run_generation(
        model_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    assert any(r.num_cached_tokens >= 32 for r in run.requests[1:]), [
        r.num_cached_tokens for r in run.requests
    ]
    assert run.outputs == expected_outputs(model_dir, prompts, max_tokens)


def test_preemption_keeps_outputs_identical(family, run_generation):
    name, model_dir = family
    prompts, max_tokens = workload(name, 3)
    run = run_generation(
        model_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=4,
        num_kv_blocks=20,  # the largest request needs 15 blocks, all of them together ~100
        max_num_batched_tokens=16,
    )
    assert run.scheduler.num_preemptions_total > 0
    assert run.outputs == expected_outputs(model_dir, prompts, max_tokens)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_match_single_rank(family, tp_size):
    """Each rank loads its rows of the fused Phi-3 projections, rotates its own heads (the
    partial ones too) and skips rotary in the NoPE layers; tp=4 replicates the 2 KV heads."""
    name, model_dir = family
    prompt_a, prompt_b = mixed_prompts(5, [40, 6])
    tables = [list(range(11)), [11, 12]]  # 41 and 7 tokens by the second step
    steps = [
        (prompt_a + prompt_b, [0, 0], [40, 6], tables),
        ([7, 8], [40, 6], [1, 1], tables),
    ]
    single = _sharded_logits(model_dir, 1, steps)
    sharded = _sharded_logits(model_dir, tp_size, steps)
    for a, b in zip(single, sharded):
        assert a.shape == b.shape == (a.shape[0], 512)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bf16_fused_ops_equal_torch_ops_with_partial_rotary(
    family_dirs, tmp_path_factory, tiny_tokenizer_dir, run_generation
):
    """bf16: the rotary kernel over gathered partial-rotary rows rounds where torch rounds."""
    if not NATIVE_POSSIBLE:
        pytest.skip("no native kernels on this host")
    if "phi4-long" not in family_dirs:
        family_dirs["phi4-long"] = _build(tmp_path_factory, tiny_tokenizer_dir, "phi4-long")
    model_dir = family_dirs["phi4-long"]
    prompts, _ = workload("phi4-long", 2)
    params = [greedy_params(10)] * len(prompts)
    fused = run_generation(model_dir, prompts, params, block_size=4, dtype="bfloat16")
    plain = run_generation(
        model_dir, prompts, params, block_size=4, dtype="bfloat16", cpu_fused_ops=False
    )
    assert fused.runner.num_fused_modules > 0 and plain.runner.num_fused_modules == 0
    assert fused.outputs == plain.outputs


def test_longrope_regime_follows_the_served_context(family_dirs, tmp_path_factory,
                                                    tiny_tokenizer_dir):  # fmt: skip
    """Long factors when the engine serves past original_max_position_embeddings, short ones
    when a runner tells the model it serves no more (hf_config.max_model_len)."""
    from replica.loader import load_hf_config, load_model

    if "phi4-long" not in family_dirs:
        family_dirs["phi4-long"] = _build(tmp_path_factory, tiny_tokenizer_dir, "phi4-long")
    model_dir = family_dirs["phi4-long"]
    served_long = load_model(model_dir).model.rotary_emb
    config = load_hf_config(model_dir)
    config.max_model_len = ORIGINAL_CONTEXT
    served_short = load_model(model_dir, config).model.rotary_emb
    assert served_long.rotary_dim == served_short.rotary_dim == 12
    assert not torch.equal(served_long.cos[:32], served_short.cos[:32])


def test_an_engine_serving_no_more_than_the_original_context_matches_transformers(
    family_dirs, tmp_path_factory, tiny_tokenizer_dir, run_generation
):
    """The runner tells the model its max_model_len: a long-context Phi-4-mini-like checkpoint
    served at max_model_len <= original_max_position_embeddings rotates with the short factors,
    as transformers does for sequences that short."""
    if "phi4-long" not in family_dirs:
        family_dirs["phi4-long"] = _build(tmp_path_factory, tiny_tokenizer_dir, "phi4-long")
    model_dir = family_dirs["phi4-long"]
    prompts = mixed_prompts(7, [9, 14, 20])
    max_tokens = [8, 10, 6]  # every sequence stays within the original 32 positions
    run = run_generation(
        model_dir, prompts, [greedy_params(n) for n in max_tokens], block_size=4,
        max_model_len=ORIGINAL_CONTEXT,
    )  # fmt: skip
    assert run.outputs == expected_outputs(model_dir, prompts, max_tokens)


# -- loading -----------------------------------------------------------------------------------
def test_fused_projection_of_the_wrong_size_is_a_clear_error(
    family_dirs, tmp_path_factory, tiny_tokenizer_dir
):
    from safetensors.torch import load_file, save_file

    from replica.loader import CheckpointError, load_model

    if "phi3-long" not in family_dirs:
        family_dirs["phi3-long"] = _build(tmp_path_factory, tiny_tokenizer_dir, "phi3-long")
    source = family_dirs["phi3-long"]
    broken = tmp_path_factory.mktemp("phi3-broken")
    for item in source.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    assert tensors[name].shape == (128, 64)  # 4 query heads and 2 + 2 KV heads of 16
    tensors[name] = tensors[name][:112]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \[112, 64\].*expects \[128, 64\]"):
        load_model(broken)


def test_smollm3_nope_layers_follow_the_config():
    from types import SimpleNamespace

    from replica.models.smollm3 import rope_layers

    assert rope_layers(SimpleNamespace(num_hidden_layers=8, no_rope_layer_interval=4)) == [
        True, True, True, False, True, True, True, False,
    ]  # fmt: skip
    explicit = SimpleNamespace(num_hidden_layers=3, no_rope_layers=[0, 1, 1, 1])
    assert rope_layers(explicit) == [False, True, True]
    with pytest.raises(ValueError, match="no_rope_layers has 2 entries; expected one per layer"):
        rope_layers(SimpleNamespace(num_hidden_layers=3, no_rope_layers=[1, 0]))


MINIMAL = {
    "Phi3ForCausalLM": {"model_type": "phi3"},
    "SmolLM3ForCausalLM": {"model_type": "smollm3"},
}


@pytest.mark.parametrize("arch", sorted(MINIMAL))
def test_minimal_config_json_reads_as_transformers_does(arch, tmp_path):
    """A config.json that leaves every optional field out: our defaults are transformers'."""
    from transformers import AutoConfig

    from replica.layers.rotary import RotaryEmbedding, rope_parameters
    from replica.loader import load_hf_config
    from replica.models.llama import head_dim_of, num_kv_heads_of
    from replica.runner import model_max_len

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], **MINIMAL[arch]}))
    ours, theirs = load_hf_config(tmp_path), AutoConfig.from_pretrained(str(tmp_path))

    def read(config) -> dict:
        return {
            "head_dim": head_dim_of(config),
            "kv_heads": num_kv_heads_of(config),
            "max_len": model_max_len(config),
            "eps": float(config.rms_norm_eps),
            "tied": bool(config.tie_word_embeddings),
            **{f: getattr(config, f) for f in ("vocab_size", "hidden_size",
                                               "intermediate_size", "num_hidden_layers")},
        }  # fmt: skip

    assert read(ours) == read(theirs)
    tables = []
    for config in (ours, theirs):
        theta, scaling = rope_parameters(config)
        tables.append(RotaryEmbedding(head_dim_of(config), 64, theta, scaling).cos)
    assert torch.equal(tables[0], tables[1])


@pytest.mark.timeout(180)
def test_phi4_mini_over_a_real_tp2_group_matches_transformers(
    family_dirs, tmp_path_factory, tiny_tokenizer_dir, run_generation
):
    """tp=2 over gloo (rank 1 a local process): fused projections loaded by rows per rank,
    partial rotary, tied head; chunked prefill and preemption in one run."""
    from replica.config import EngineConfig
    from replica.parallel import TensorParallelRunner

    if "phi4-long" not in family_dirs:
        family_dirs["phi4-long"] = _build(tmp_path_factory, tiny_tokenizer_dir, "phi4-long")
    model_dir = family_dirs["phi4-long"]
    config = EngineConfig(model=str(model_dir), device="cpu", block_size=4, num_kv_blocks=256,
                          tensor_parallel_size=2)  # fmt: skip
    runner = TensorParallelRunner(config, model_dir)
    try:
        prompts, max_tokens = workload("phi4-long", 3)
        run = run_generation(model_dir, prompts, [greedy_params(n) for n in max_tokens],
                             runner=runner, block_size=4, num_kv_blocks=20,
                             max_num_batched_tokens=16)  # fmt: skip
    finally:
        runner.shutdown()
    assert run.scheduler.num_preemptions_total > 0
    assert run.outputs == expected_outputs(model_dir, prompts, max_tokens)
