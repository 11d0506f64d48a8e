"""Qwen3, Qwen3-MoE, Mixtral and OLMoE: greedy fp32 token-identical to transformers through
batching, chunked prefill, prefix caching and preemption, on the native CPU kernels and on the
plain torch path; tp=2 logits equal tp=1's; the sparse MoE layer equals a per-token reference;
clear errors for what is not supported."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from replica.layers.linear import PackableLinear, TensorParallel, pack_linear_weights
from replica.layers.moe import SparseMoeBlock, route
from replica.tiny_models_moe import FAMILIES, build_tiny_family
from tests.replica.test_model_parity import (
    MAX_TOKENS,
    PROMPT_LENGTHS,
    _sharded_logits,
    expected_outputs,
    greedy_params,
    mixed_prompts,
)

pytestmark = pytest.mark.timeout(300)
SEEDS = {"qwen3": 31, "qwen3_moe": 32, "mixtral": 33, "olmoe": 34}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    dirs = {}
    for family in FAMILIES:
        out = tmp_path_factory.mktemp(f"tiny-{family}")
        build_tiny_family(out, tiny_tokenizer_dir, family, seed=SEEDS[family])
        dirs[family] = out
    return dirs


@pytest.fixture(params=list(FAMILIES))
def family_dir(request, family_dirs) -> Path:
    return family_dirs[request.param]


PLAIN_TORCH = dict(pack_cpu_weights=False, cpu_decode_attention="torch", cpu_fused_ops=False)


@pytest.mark.parametrize("path", ["native", "plain"])
@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_greedy_batch_matches_transformers(
    family_dir, run_generation, max_num_batched_tokens, path
):
    """Chunked prefill (16-token steps) and one big step; with the native kernels and oneDNN
    packing (every expert's linears packed too), and on plain torch ops."""
    prompts = mixed_prompts(0, PROMPT_LENGTHS)
    run = run_generation(
        family_dir,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        **(PLAIN_TORCH if path == "plain" else {}),
    )
    assert run.outputs == expected_outputs(family_dir, prompts, MAX_TOKENS)
    runner = run.runner
    if path == "plain":
        assert runner.num_packed_layers == 0 and runner.num_fused_modules == 0
    elif torch.backends.mkldnn.is_available():
        linears = [m for m in runner.model.modules() if isinstance(m, PackableLinear)]
        assert runner.num_packed_layers == len(linears)


def test_shared_prefixes_in_chunks_match_transformers(family_dir, run_generation):
    """Prefix-cache hits (prefills that start after cached context), in 24-token chunks."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 30)]
    prompts += mixed_prompts(2, [61, 2, 35])
    max_tokens = [9, 6, 11, 8, 12, 7]
    run = run_generation(
        family_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    assert any(r.num_cached_tokens >= 32 for r in run.requests[1:3])
    assert run.outputs == expected_outputs(family_dir, prompts, max_tokens)


def test_preemption_keeps_outputs_identical(family_dir, run_generation):
    prompts = mixed_prompts(3, [14, 19, 22, 9, 17, 25, 12, 20])
    run = run_generation(
        family_dir,
        prompts,
        greedy_params(16),
        block_size=4,
        num_kv_blocks=24,  # the largest request needs 11 blocks; all of them need ~80
        max_num_batched_tokens=16,
    )
    assert run.scheduler.num_preemptions_total > 0
    assert run.outputs == expected_outputs(family_dir, prompts, [16] * len(prompts))


def test_tensor_parallel_shards_match_single_rank(family_dir):
    """tp=2 (threads standing in for ranks): attention heads, the q/k norms (OLMoE's summed
    across ranks) and every expert's intermediate dimension split; the same logits as tp=1."""
    prompt_a, prompt_b = mixed_prompts(5, [9, 6])
    steps = [
        (prompt_a + prompt_b, [0, 0], [9, 6], [[0, 1, 2], [3, 4]]),
        ([7, 8], [9, 6], [1, 1], [[0, 1, 2], [3, 4]]),
    ]
    single = _sharded_logits(family_dir, 1, steps)
    sharded = _sharded_logits(family_dir, 2, steps)
    for a, b in zip(single, sharded, strict=True):
        assert a.shape == (a.shape[0], 512)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# -- the sparse MoE layer against a per-token reference ----------------------------------------
def _random_block(
    num_experts: int, top_k: int, renormalize: bool, seed: int, tp=None
) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(32, 24, num_experts, top_k, renormalize, tp or TensorParallel())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: softmax, top-k, optional renormalisation, SwiGLU."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ block.gate.weight.T, dim=-1)
        weights, ids = probs.topk(block.top_k)
        if block.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            expert = block.experts[e]
            gate, up = (expert.gate_up_proj.weight @ x[t]).chunk(2)
            out[t] += w * (expert.down_proj.weight @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "renormalize"), [
    (1, 8, 2, True),  # decode of one token: six experts get no rows
    (3, 16, 2, False),  # most experts idle
    (37, 8, 3, False),
    (64, 4, 4, True),  # every expert, every token
])  # fmt: skip
def test_moe_layer_equals_per_token_reference(num_tokens, num_experts, top_k, renormalize, fused):
    from replica.layers.cpu_kernels import native_library

    if fused and native_library() is None:
        pytest.skip("native kernels not built here")
    block = _random_block(num_experts, top_k, renormalize, seed=num_tokens)
    block.fused_cpu_ops = fused
    x = torch.randn(num_tokens, 32)
    _, ids = route(x @ block.gate.weight.T, top_k, renormalize)
    if num_tokens * top_k < num_experts:
        assert len(ids.unique()) < num_experts  # some experts get no rows
    torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-5, atol=1e-5)


def test_moe_layer_packed_weights_equal_row_major():
    block = _random_block(8, 2, True, seed=3)
    x = torch.randn(10, 32)
    want = block(x)
    if pack_linear_weights(block) == 0:
        pytest.skip("oneDNN packing not available")
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


def test_moe_layer_shards_sum_to_the_full_layer():
    """Each rank's partial output over its slice of every expert's intermediate dimension sums
    to the unsharded layer's (the all-reduce here is that sum)."""
    full = _random_block(8, 2, False, seed=4)
    x = torch.randn(12, 32)
    partial = []
    for rank in range(2):
        shard = SparseMoeBlock(32, 24, 8, 2, False, TensorParallel(rank, 2))
        for name, param in shard.named_parameters():
            source = dict(full.named_parameters())[name]
            if name.endswith("gate_up_proj.weight"):
                param.weight_loader(param, source[:24], 0)
                param.weight_loader(param, source[24:], 1)
            else:
                param.weight_loader(param, source)
        weights, ids = route(x @ shard.gate.weight.T, 2, False)
        partial.append(shard.combine_experts(x, weights, ids))
    torch.testing.assert_close(partial[0] + partial[1], full(x), rtol=1e-5, atol=1e-5)


# -- configuration -----------------------------------------------------------------------------
def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_unsupported_configurations_name_the_value(family_dirs, tmp_path):
    from replica.loader import load_model

    bad_k = _with_config(family_dirs["mixtral"], tmp_path / "k", num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\).*number of experts \(8\)"):
        load_model(bad_k)
    bad_act = _with_config(family_dirs["olmoe"], tmp_path / "act", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'.*supported: 'silu'"):
        load_model(bad_act)
    one_kv = _with_config(family_dirs["olmoe"], tmp_path / "kv", num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(1\) >= tensor_parallel_size"):
        load_model(one_kv, tp=TensorParallel(0, 2))
    odd = _with_config(family_dirs["qwen3_moe"], tmp_path / "odd", moe_intermediate_size=34)
    with pytest.raises(ValueError, match=r"output size \(34\) is not divisible.*\(4\)"):
        load_model(odd, tp=TensorParallel(0, 4))


def test_mixtral_expert_tensors_are_required_by_their_checkpoint_names(family_dirs, tmp_path):
    """Mixtral's block_sparse_moe.experts.{e}.w1/w2/w3 map onto our names and back: a missing
    one is reported under the checkpoint's name."""
    from safetensors.torch import load_file, save_file

    from replica.loader import CheckpointError, load_model

    out = tmp_path / "mixtral"
    shutil.copytree(family_dirs["mixtral"], out)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"block_sparse_moe\.experts\.5\.w2\.weight"):
        load_model(out)


MINIMAL = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}
MOE_FIELDS = ["num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
              "decoder_sparse_step", "mlp_only_layers", "clip_qkv"]  # fmt: skip


@pytest.mark.parametrize("arch", sorted(MINIMAL))
def test_minimal_config_json_reads_as_transformers_does(arch, tmp_path):
    """Fields config.json leaves out take transformers' defaults (ARCH_DEFAULTS)."""
    from transformers import AutoConfig

    from replica.loader import load_hf_config
    from replica.models.moe import num_experts_of
    from tests.replica.test_loader import _as_read

    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text(
        json.dumps({"architectures": [arch], "model_type": MINIMAL[arch]})
    )
    ours, theirs = load_hf_config(out), AutoConfig.from_pretrained(str(out))
    assert _as_read(ours) == _as_read(theirs)
    assert num_experts_of(ours) == num_experts_of(theirs)
    for field in MOE_FIELDS:
        assert getattr(ours, field, None) == getattr(theirs, field, None), field


@pytest.mark.timeout(180)
def test_tp2_over_gloo_matches_transformers(family_dirs, run_generation):
    """A real tensor-parallel group (rank 1 a local process, gloo): Qwen3-MoE's experts and
    q/k norms sharded, chunked prefill; the tokens transformers gives."""
    from replica.parallel import TensorParallelRunner
    from tests.replica.test_tensor_parallel import tp_config

    model_dir = family_dirs["qwen3_moe"]
    runner = TensorParallelRunner(tp_config(model_dir), model_dir)
    try:
        prompts = mixed_prompts(0, PROMPT_LENGTHS)
        params = [greedy_params(n) for n in MAX_TOKENS]
        run = run_generation(
            model_dir, prompts, params, runner=runner, block_size=4, max_num_batched_tokens=16
        )
    finally:
        runner.shutdown()
    assert run.outputs == expected_outputs(model_dir, prompts, MAX_TOKENS)
