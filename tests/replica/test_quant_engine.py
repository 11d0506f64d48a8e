"""The engine on quantized weights. A tiny GGUF (mixed block formats, Q8_0 tied embedding) run
with fp32 activations is token-identical to transformers' greedy generation from the same file,
whatever the batching: token budgets, chunked prefill over prefix-cache hits, preemption, two
tensor-parallel ranks. With int8 activations, and with quantization="int8" of a float
checkpoint, logits stay within measured bounds of the exact ones. The weights' resident bytes
reach the engine's start-up info."""

from __future__ import annotations

import random

import pytest

from replica.config import EngineConfig
from replica.quant.weights import QuantizedWeight
from replica.runner import ModelRunner
from tests.replica.quant_helpers import hf_expected, prompt_logits, tiny_gguf_dir
from tests.replica.test_model_parity import greedy_params

PROMPT_LENGTHS = [1, 2, 5, 9, 17, 24, 33, 40, 47, 3]
MAX_TOKENS = [12, 9, 16, 7, 20, 11, 14, 8, 13, 18]
EXACT = {"quant_activations": "fp32"}


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llama_gguf():
    return tiny_gguf_dir("llama")


# -- fp32 activations: token-identical to transformers -----------------------------------------
@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_gguf_greedy_batches_match_transformers(llama_gguf, run_generation, max_num_batched_tokens):
    prompts = prompts_of(0, PROMPT_LENGTHS)
    run = run_generation(
        llama_gguf,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        **EXACT,
    )
    runner = run.runner
    assert runner.num_quantized_weights == 11 and runner.quant_activations == "fp32"
    assert runner.num_packed_layers == 2  # layer 1's float o_proj and gate_up only
    assert run.outputs == hf_expected(llama_gguf, prompts, MAX_TOKENS)


def test_gguf_chunked_prefill_over_prefix_hits_matches_transformers(llama_gguf, run_generation):
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 30)]
    prompts += prompts_of(2, [61, 2, 35])
    max_tokens = [9, 6, 11, 8, 12, 7]
    run = run_generation(
        llama_gguf,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        **EXACT,
    )
    assert any(r.num_cached_tokens >= 32 for r in run.requests[1:3])
    assert run.outputs == hf_expected(llama_gguf, prompts, max_tokens)


def test_gguf_preemption_keeps_outputs_identical(llama_gguf, run_generation):
    prompts = prompts_of(3, [14, 19, 22, 9, 17, 25, 12, 20])
    run = run_generation(
        llama_gguf,
        prompts,
        greedy_params(16),
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
        **EXACT,
    )
    assert run.scheduler.num_preemptions_total > 0
    assert run.outputs == hf_expected(llama_gguf, prompts, [16] * len(prompts))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3", "qwen3moe", "phi3"])
def test_other_gguf_architectures_match_transformers(arch, run_generation):
    """Qwen2 (QKV biases, untied), Qwen3 (q/k norms, K-quant o_proj), Gemma 3 (1 + w norms,
    sliding window), Qwen3-MoE (quantized experts, a Q8_0 router), Phi-3 (fused qkv and
    gate_up tensors, split by rows)."""
    sidecar = tiny_gguf_dir(arch)
    prompts = prompts_of(1, [3, 30, 11, 22])  # gemma3's window (16) is shorter than some
    max_tokens = [10, 8, 12, 9]
    run = run_generation(
        sidecar,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=4,
        max_num_batched_tokens=16,
        **EXACT,
    )
    assert run.outputs == hf_expected(sidecar, prompts, max_tokens)


@pytest.mark.timeout(180)
def test_gguf_tp2_matches_tp1_and_transformers(llama_gguf, run_generation):
    """Two ranks (gloo): each holds half the heads and the vocabulary, and 256 of down_proj's
    512 K-quant columns: a whole block per row."""
    from replica.parallel import TensorParallelRunner
    from tests.replica.test_tensor_parallel import tp_config

    prompts = prompts_of(0, PROMPT_LENGTHS)
    params = [greedy_params(n) for n in MAX_TOKENS]
    runner = TensorParallelRunner(tp_config(llama_gguf, **EXACT), llama_gguf)
    try:
        assert runner.weight_bytes["quantized_bytes"] > 0
        fields = {"block_size": 4, "max_num_batched_tokens": 16, **EXACT}
        sharded = run_generation(llama_gguf, prompts, params, runner=runner, **fields)
    finally:
        runner.shutdown()
    assert sharded.outputs == hf_expected(llama_gguf, prompts, MAX_TOKENS)


# -- int8 activations; quantization="int8" --------------------------------------------------------
def _runner(model_dir, **fields) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64, **fields)
    return ModelRunner(config, model_dir)


def _compare(
    a: ModelRunner, b: ModelRunner, prompts: list[list[int]]
) -> tuple[float, float, float]:
    """|logit difference| relative to the logits' standard deviation, the largest and the
    mean over every position and token; and the fraction of positions whose top-1 token
    agrees."""
    worst, mean, agree, total = 0.0, 0.0, 0, 0
    for prompt in prompts:
        la, lb = prompt_logits(a, prompt), prompt_logits(b, prompt)
        diff = (la - lb).abs() / lb.std()
        worst = max(worst, diff.max().item())
        mean += diff.mean().item() * len(prompt)
        agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
        total += len(prompt)
    return worst, mean / total, agree / total


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_activations_stay_close_to_exact(arch):
    """Activations rounded to int8 per group of 32 (the default), against fp32 activations,
    over 129 positions: measured (reference kernels) llama 0.17 / 0.018 standard deviations
    largest / mean difference and 94% of top-1 tokens the same, gemma3 0.09 / 0.011 and 95%.
    Over 49152 random-weight logits the top two are often nearly tied (typical gap ~0.2
    standard deviations), hence the flips; bounds with margin."""
    sidecar = tiny_gguf_dir(arch)
    exact = _runner(sidecar, **EXACT)
    fast = _runner(sidecar)  # quant_activations auto -> int8
    assert fast.quant_activations == "int8"
    worst, mean, agree = _compare(fast, exact, prompts_of(7, [64, 40, 25]))
    assert worst < 0.3 and mean < 0.03 and agree >= 0.88, (worst, mean, agree)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_int8_quantization_of_a_float_checkpoint(model, tiny_llama_dir, tiny_qwen2_dir):
    """Every linear weight becomes Q8_0 as it loads (the tiny Llama's untied LM head too, the
    tiny Qwen2's tied embedding with it). Against the float model over 144 positions,
    measured with fp32 activations: llama 0.053 / 0.012 standard deviations largest / mean
    difference, qwen2 0.041 / 0.009; with int8 activations too llama 0.078 / 0.017, qwen2
    0.056 / 0.012; every top-1 token the same. Bounds with margin."""
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[model]
    base = _runner(model_dir)
    int8 = _runner(model_dir, quantization="int8", **EXACT)
    layers = int8.model.model.layers
    for layer in layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(linear.weight, QuantizedWeight) and linear.weight.qtypes == ["Q8_0"]
    embed = int8.model.model.embed_tokens.weight
    assert isinstance(int8.model.lm_head.weight, QuantizedWeight)
    assert isinstance(embed, QuantizedWeight) == (model == "qwen2")  # only a tied one
    assert int8.num_packed_layers == 0
    assert int8.weight_bytes["quantized_bytes"] > 0
    assert int8.weight_bytes["total_bytes"] < 0.5 * base.weight_bytes["total_bytes"]
    prompts = [[random.Random(i).randrange(3, 512) for _ in range(48)] for i in range(3)]
    worst, mean, agree = _compare(int8, base, prompts)
    assert worst < 0.1 and mean < 0.02 and agree >= 0.97, (worst, mean, agree)
    both = _runner(model_dir, quantization="int8")
    worst, mean, agree = _compare(both, base, prompts)
    assert worst < 0.15 and mean < 0.03 and agree >= 0.97, (worst, mean, agree)


# -- start-up info -------------------------------------------------------------------------------
def test_weight_bytes_reach_the_engines_startup_info(llama_gguf, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from replica.engine import Engine
    from replica.engine.core_process import ready_message

    config = EngineConfig(model=str(llama_gguf), device="cpu", num_kv_blocks=32)
    engine = Engine(config, tokenizer=AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    try:
        sizes = engine.weight_bytes
        assert sizes == engine.runner.weight_bytes
        assert sizes["total_bytes"] == sizes["quantized_bytes"] + sizes["float_bytes"]
        assert 49152 * 64 // 32 * 34 < sizes["quantized_bytes"] < 4 * 49152 * 64
        assert ready_message(engine, config, False).info.weight_bytes == sizes
    finally:
        engine.shutdown()
