"""Greedy fp32 output of Scheduler + ModelRunner is token-identical to transformers' generate,
whatever the batching: token budgets, prefix caching, preemption, tensor-parallel shards."""

from __future__ import annotations

import functools
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from replica.config import EngineConfig
from replica.layers.attention import TorchSDPAMetadata
from replica.layers.linear import TensorParallel
from replica.loader import build_model, load_hf_config, load_weights, safetensors_files
from replica.request import SamplingParams
from replica.runner import ModelRunner, StepBatch
from tests.replica.test_cpu_kernels import NATIVE_POSSIBLE, needs_native


@functools.cache
def _hf_model(model_dir: Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    return model.to(device).eval()


@functools.cache
def hf_greedy(
    model_dir: Path,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    stop_at_eos: bool,
    device: str = "cpu",
):
    """transformers' greedy continuation of one prompt (no padding: one prompt at a time), fp32
    with eager attention on `device`."""
    from transformers import GenerationConfig

    model = _hf_model(model_dir, device)
    # no EOS at all: transformers reads None as "the model's own EOS"
    eos = model.generation_config.eos_token_id if stop_at_eos else []
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def mixed_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPT_LENGTHS = [1, 2, 5, 9, 17, 24, 33, 40, 47, 3]
MAX_TOKENS = [12, 9, 16, 7, 20, 11, 14, 8, 13, 18]


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def expected_outputs(
    model_dir: Path, prompts: list[list[int]], max_tokens: list[int], device: str = "cpu"
):
    return [hf_greedy(model_dir, tuple(p), n, False, device) for p, n in zip(prompts, max_tokens)]


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model_dir(request, tiny_llama_dir, tiny_qwen2_dir) -> Path:
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]


@pytest.mark.parametrize("max_num_batched_tokens", [16, 64, 4096])
def test_greedy_batch_matches_transformers(
    tiny_model_dir, run_generation, max_num_batched_tokens, cpu_isa_level
):
    """At every instruction-set level this CPU runs (native kernels and packing as a CPU of
    that level would pick them)."""
    prompts = mixed_prompts(0, PROMPT_LENGTHS)
    run = run_generation(
        tiny_model_dir,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert run.outputs == expected_outputs(tiny_model_dir, prompts, MAX_TOKENS)


def test_plain_torch_path_matches_transformers_too(tiny_llama_dir, run_generation):
    """pack_cpu_weights=False keeps the row-major F.linear path, cpu_decode_attention="torch"
    the gathered-blocks SDPA decode path and cpu_fused_ops=False torch's norm, rotary and SiLU;
    together they are exact as well."""
    prompts = mixed_prompts(0, PROMPT_LENGTHS)
    run = run_generation(
        tiny_llama_dir,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        block_size=4,
        max_num_batched_tokens=64,
        pack_cpu_weights=False,
        cpu_decode_attention="torch",
        cpu_fused_ops=False,
    )
    assert run.runner.num_packed_layers == 0 and not run.runner.native_decode
    assert run.runner.num_fused_modules == 0
    assert run.outputs == expected_outputs(tiny_llama_dir, prompts, MAX_TOKENS)


@needs_native
@pytest.mark.parametrize("prefill", ["native", "torch"])
def test_prefill_attention_paths_match_transformers_over_chunks_and_prefix_hits(
    tiny_model_dir, run_generation, prefill, cpu_isa_level
):
    """Prompts that share prefixes (prefix-cache hits: a prefill starts after cached context)
    and run in chunks of 24 tokens (each chunk after the last), with the native tiled prefill
    kernel and with torch SDPA: both exact."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 30)]
    prompts += mixed_prompts(2, [61, 2, 35])
    max_tokens = [9, 6, 11, 8, 12, 7]
    run = run_generation(
        tiny_model_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        cpu_prefill_attention=prefill,
    )
    from replica.layers.attention.native_decode import VECTOR_PREFILL_LEVELS

    # the native kernel runs where its build has vector code (AVX2 and up)
    wanted = prefill == "native" and cpu_isa_level in VECTOR_PREFILL_LEVELS
    assert run.runner.native_prefill == wanted
    # later prompts found the shared prefix cached (their prefill started after it)
    assert any(r.num_cached_tokens >= 32 for r in run.requests[1:3]), [
        r.num_cached_tokens for r in run.requests
    ]
    assert run.outputs == expected_outputs(tiny_model_dir, prompts, max_tokens)


@pytest.fixture(scope="module")
def tiny_long_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The tiny Llama with room for prompts past the native prefill's AVX2 key limit."""
    from replica.tiny_models import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-llama-2k")
    build_tiny_model(out, tiny_tokenizer_dir, "llama", seed=4, max_position_embeddings=2048)
    return out


@needs_native
def test_long_prefills_match_transformers_on_either_side_of_the_key_limit(
    tiny_long_llama_dir, run_generation, cpu_isa_level
):
    """Prompts of 1100-1300 tokens, in chunks of 256 and after a cached prefix of 1024, so most
    of their queries attend more keys than NATIVE_PREFILL_MAX_KEYS: at the AVX-512 levels they
    take the native kernel (no limit there), at AVX2 torch SDPA; exact either way."""
    from replica.layers.attention.native_decode import (
        NATIVE_PREFILL_MAX_KEYS,
        NO_KEY_LIMIT_LEVELS,
        VECTOR_PREFILL_LEVELS,
    )

    rng = random.Random(11)
    shared = [rng.randrange(3, 512) for _ in range(1024)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (76, 276)]
    prompts.append([rng.randrange(3, 512) for _ in range(1200)])
    max_tokens = [5, 4, 6]
    run = run_generation(
        tiny_long_llama_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=16,
        max_num_batched_tokens=256,
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    assert run.runner.native_prefill == (cpu_isa_level in VECTOR_PREFILL_LEVELS)
    if run.runner.native_prefill:
        unlimited = cpu_isa_level in NO_KEY_LIMIT_LEVELS
        assert run.runner.attn_builder.max_keys == (None if unlimited else NATIVE_PREFILL_MAX_KEYS)
    assert max(r.num_cached_tokens for r in run.requests[:2]) >= 1024
    assert run.outputs == expected_outputs(tiny_long_llama_dir, prompts, max_tokens)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_cpu_weights_are_packed_once_and_the_row_major_copies_released(
    tiny_llama_dir, run_generation
):
    run = run_generation(tiny_llama_dir, [[5, 6, 7]], greedy_params(4), block_size=4)
    runner = run.runner
    layers = runner.num_layers
    # per layer qkv, o, gate_up, down; plus the LM head
    assert runner.num_packed_layers == 4 * layers + 1
    attn = runner.model.model.layers[0].self_attn
    assert attn.qkv_proj.packed_weight is not None and attn.qkv_proj.weight.numel() == 0
    head = runner.model.lm_head
    assert head.packed_weight is not None
    # a tied LM head keeps the weight the embedding looks rows up in
    assert head.weight.numel() == (
        0 if head.release_after_packing else head.weight.shape[0] * head.weight.shape[1]
    )


@needs_native
def test_cpu_runs_use_the_fused_ops_in_fp32_and_bf16(tiny_llama_dir, run_generation, cpu_isa_level):
    """The parity tests above run with the defaults: the fused C ops on in every norm, attention
    (rotary; the K/V cache writes) and MLP module. In bf16 they round where torch's ops round,
    so greedy tokens equal the torch ops' run."""
    runner = run_generation(tiny_llama_dir, [[5, 6, 7]], greedy_params(4), block_size=4).runner
    assert runner.num_fused_modules == 5 * runner.num_layers + 1
    prompts = mixed_prompts(2, [5, 17, 40])
    params = [greedy_params(12)] * len(prompts)
    fused = run_generation(tiny_llama_dir, prompts, params, block_size=4, dtype="bfloat16")
    plain = run_generation(
        tiny_llama_dir, prompts, params, block_size=4, dtype="bfloat16", cpu_fused_ops=False
    )
    assert fused.runner.num_fused_modules == 5 * fused.runner.num_layers + 1
    assert plain.runner.num_fused_modules == 0
    assert fused.outputs == plain.outputs


def test_mistral_matches_transformers_and_keeps_its_full_context(tiny_mistral_dir, run_generation):
    """The sliding window (256) limits what each layer attends to, not the context: the model's
    max_model_len is its max_position_embeddings (512). Windows shorter than the prompts:
    tests/replica/test_sliding_window.py."""
    prompts = mixed_prompts(6, PROMPT_LENGTHS)
    run = run_generation(
        tiny_mistral_dir,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        block_size=8,
        max_num_batched_tokens=32,
    )
    assert run.outputs == expected_outputs(tiny_mistral_dir, prompts, MAX_TOKENS)
    assert run.runner.max_model_len == 512
    assert run.runner.kv_sliding_window == 256


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_shared_prefixes_match_with_and_without_prefix_cache(
    tiny_llama_dir, run_generation, enable_prefix_caching, max_num_batched_tokens
):
    system = mixed_prompts(1, [21])[0]
    suffixes = mixed_prompts(2, [1, 4, 7, 3, 11, 2, 6, 9])
    prompts = [system + s for s in suffixes] + [system[:13]]
    max_tokens = [10] * len(prompts)
    run = run_generation(
        tiny_llama_dir,
        prompts,
        greedy_params(10),
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
    )
    assert run.outputs == expected_outputs(tiny_llama_dir, prompts, max_tokens)
    hits = run.scheduler.prefix_cache_hits
    # with one big step every later prompt hits blocks an earlier one is writing in that step
    assert hits > 0 if enable_prefix_caching else hits == 0


@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_preemption_keeps_outputs_identical(tiny_qwen2_dir, run_generation, max_num_batched_tokens):
    prompts = mixed_prompts(3, [14, 19, 22, 9, 17, 25, 12, 20])
    max_tokens = [16] * len(prompts)
    run = run_generation(
        tiny_qwen2_dir,
        prompts,
        greedy_params(16),
        block_size=4,
        num_kv_blocks=24,  # the largest request needs 11 blocks; all of them need ~80
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert run.scheduler.num_preemptions_total > 0
    assert run.outputs == expected_outputs(tiny_qwen2_dir, prompts, max_tokens)


def test_eos_stops_like_transformers(tiny_llama_dir, tiny_tokenizer_dir, run_generation):
    """Without ignore_eos, a request ends at EOS exactly where transformers stops."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    texts = ["The key and value", "A block table maps", "Numbers such as 12"]
    prompts = [tokenizer.encode(t) for t in texts]
    run = run_generation(
        tiny_llama_dir, prompts, SamplingParams(temperature=0.0, max_tokens=24), block_size=8
    )
    expected = [hf_greedy(tiny_llama_dir, tuple(p), 24, True) for p in prompts]
    assert run.outputs == expected


def test_llm_generate_matches_transformers(tiny_llama_dir):
    """The offline LLM entry point, when the engine is importable, gives the same tokens."""
    engine = pytest.importorskip("replica.engine")
    prompts = mixed_prompts(4, [5, 12, 30])
    llm = engine.LLM(
        model=tiny_llama_dir,
        device="cpu",
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
    )
    outputs = llm.generate(prompts, greedy_params(10))
    assert [o.output_token_ids for o in outputs] == expected_outputs(
        tiny_llama_dir, prompts, [10, 10, 10]
    )


def test_default_model_matches_transformers(dequantized_default_model_dir, run_generation):
    """SmolLM2-135M-Instruct, de-quantized to fp32 from the packaged GGUF, 32 greedy tokens
    (EOS honoured)."""
    from transformers import AutoTokenizer

    default_model_dir = dequantized_default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "2+2="]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    run = run_generation(
        default_model_dir,
        prompt_ids,
        SamplingParams(temperature=0.0, max_tokens=32),
        num_kv_blocks=64,
        max_num_batched_tokens=64,
    )
    expected = [hf_greedy(default_model_dir, tuple(p), 32, True) for p in prompt_ids]
    assert run.outputs == expected
    assert "Paris" in tokenizer.decode(run.outputs[0])
    runner = run.runner
    assert (runner.num_kv_heads, runner.head_dim, runner.vocab_size) == (3, 64, 49152)
    # the native decode kernel ran these steps wherever a C compiler could build it
    assert runner.native_decode or not NATIVE_POSSIBLE


def _reference_varlen_kernel(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    block_table,
):
    """flash-attn's documented flash_attn_varlen_func semantics with a paged KV cache."""
    assert causal and block_table.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(block_table.shape[0]):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n, length = q1 - q0, int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert n <= max_seqlen_q and length <= max_seqlen_k
        keys = torch.arange(length)
        blocks = block_table[b].long()[keys // block_size]
        k = k_cache[blocks, keys % block_size].transpose(0, 1)
        v = v_cache[blocks, keys % block_size].transpose(0, 1)
        mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=True
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def test_paged_kernel_path_feeds_the_kernel_what_it_expects(
    tiny_llama_dir, run_generation, monkeypatch
):
    """The CUDA varlen/paged-kernel branch, with a reference kernel standing in for flash-attn."""
    import replica.layers.attention.flash_attn as flash_attn

    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", _reference_varlen_kernel)
    monkeypatch.setattr(flash_attn, "paged_kernel_available", lambda device, bs: True)
    prompts = mixed_prompts(7, PROMPT_LENGTHS)
    run = run_generation(
        tiny_llama_dir,
        prompts,
        [greedy_params(n) for n in MAX_TOKENS],
        block_size=4,
        max_num_batched_tokens=16,
    )
    assert run.runner.use_paged_kernel
    assert run.outputs == expected_outputs(tiny_llama_dir, prompts, MAX_TOKENS)


def test_max_model_len_beyond_the_model_is_rejected(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", max_model_len=4096)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds.*512"):
        ModelRunner(config, tiny_llama_dir)


def test_kv_blocks_sized_from_bytes(tiny_llama_dir):
    # 2 (K, V) x 2 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_bytes=10 * 8192 + 5)
    runner = ModelRunner(config, tiny_llama_dir)
    assert runner.kv_block_bytes == 8192
    assert runner.num_kv_blocks == 10
    assert runner.kv_caches[0][0].shape == (10, 16, 2, 16)
    assert runner.max_model_len == 512


def test_kv_cache_shrinks_to_its_first_blocks(tiny_llama_dir):
    """A tensor-parallel group shrinks rank 0's pool to the smallest rank's."""
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=10)
    runner = ModelRunner(config, tiny_llama_dir)
    k0 = runner.kv_caches[0][0]
    runner.shrink_kv_cache(6)
    assert runner.num_kv_blocks == 6
    assert runner.kv_caches[0][0].shape == (6, 16, 2, 16)
    assert runner.kv_caches[0][0].data_ptr() == k0.data_ptr()
    with pytest.raises(ValueError, match="cannot shrink"):
        runner.shrink_kv_cache(7)


# -- tensor parallelism, simulated with threads ------------------------------------------------
class _ThreadExchange:
    """All-gather between threads standing in for ranks."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size

    def all_gather(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return parts


@dataclass(frozen=True)
class _ThreadTP(TensorParallel):
    exchange: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = self.exchange.all_gather(self.rank, x)
        return x.copy_(functools.reduce(torch.add, parts))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        return torch.cat(self.exchange.all_gather(self.rank, x), dim=dim)


def _sharded_logits(model_dir: Path, tp_size: int, steps) -> list[torch.Tensor]:
    """Logits of every step's tokens from `tp_size` ranks running the same steps."""
    hf_config = load_hf_config(model_dir)
    files = safetensors_files(model_dir)
    exchange = _ThreadExchange(tp_size)
    results: list[Any] = [None] * tp_size

    def rank_main(rank: int) -> None:
        try:
            model = build_model(
                hf_config, _ThreadTP(rank, tp_size, None, exchange), "cpu", torch.float32
            )
            load_weights(model, files)
            attn = model.model.layers[0].self_attn
            kv_heads, d = attn.attn.num_kv_heads, attn.head_dim
            caches = [
                (torch.zeros(16, 4, kv_heads, d), torch.zeros(16, 4, kv_heads, d))
                for _ in range(model.num_layers)
            ]
            logits = []
            with torch.inference_mode():
                for ids, starts, lens, tables in steps:
                    meta, positions = TorchSDPAMetadata.build(starts, lens, tables, 4)
                    hidden = model(torch.tensor(ids), positions, caches, meta)
                    logits.append(model.compute_logits(hidden))
            results[rank] = logits
        except BaseException as exc:  # surfaced in the main thread
            exchange.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results[0]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_match_single_rank(tiny_qwen2_dir, tp_size):
    """Column/row-parallel layers, the vocab-parallel embedding and LM head, and KV heads
    replicated when there are fewer of them (2) than ranks (4) give tp=1's logits."""
    prompt_a, prompt_b = mixed_prompts(5, [9, 6])
    # step 1: both prompts' prefill; step 2: a decode of each (tokens at positions 9 and 6)
    steps = [
        (prompt_a + prompt_b, [0, 0], [9, 6], [[0, 1, 2], [3, 4]]),
        ([7, 8], [9, 6], [1, 1], [[0, 1, 2], [3, 4]]),
    ]
    single = _sharded_logits(tiny_qwen2_dir, 1, steps)
    sharded = _sharded_logits(tiny_qwen2_dir, tp_size, steps)
    for a, b in zip(single, sharded):
        assert a.shape == b.shape == (a.shape[0], 512)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bfloat16_weights_and_kv_cache(tiny_qwen2_dir, run_generation, cpu_isa_level):
    """bf16 (the GPU default) runs end to end at every level this CPU runs, with oneDNN packing
    its weights only where the level allows (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); it is close
    to, not identical with, fp32."""
    from replica.layers.cpu_isa import onednn_bf16_packing

    prompts = mixed_prompts(8, [6, 20, 3])
    run = run_generation(tiny_qwen2_dir, prompts, greedy_params(6), block_size=4, dtype="bfloat16")
    runner = run.runner
    assert runner.cpu_isa == cpu_isa_level
    packable = torch.backends.mkldnn.is_available() and onednn_bf16_packing(cpu_isa_level)
    assert runner.num_packed_layers == (4 * runner.num_layers + 1 if packable else 0)
    assert runner.dtype == torch.bfloat16 and runner.kv_caches[0][0].dtype == torch.bfloat16
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    assert runner.model.model.rotary_emb.cos.dtype == torch.float32
    assert all(len(o) == 6 and all(0 <= t < 512 for t in o) for o in run.outputs)
    fp32 = expected_outputs(tiny_qwen2_dir, prompts, [6, 6, 6])
    assert sum(o[0] == e[0] for o, e in zip(run.outputs, fp32)) >= 2


@functools.cache
def _hf_bf16_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()


def _hf_bf16_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_bf16_model(model_dir)(torch.tensor([ids])).logits[0, -1].float()


@functools.cache
def hf_bf16_greedy(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _hf_bf16_model(model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
    return out[0, len(prompt) :].tolist()


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values (8 significant bits) around x."""
    import math

    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_follows_transformers_bf16_up_to_its_own_ties(
    arch, tiny_llama_dir, tiny_qwen2_dir, run_generation, cpu_isa_level
):
    """Greedy bf16 against transformers' own bf16 greedy (SDPA), at every level this CPU runs.
    The arithmetic is not the same op for op (fused qkv and gate_up projections reduce in
    another order than three separate ones, the paged decode kernel accumulates in fp32), so
    a continuation may part from transformers' only where transformers itself sees a tie: at
    the first differing token, the two candidates' bf16 logits in transformers' own forward
    are within 2 bf16 ulps (seen here: 0 or 1 ulp). Everything before it is identical."""
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[arch]
    prompts = mixed_prompts(8, [6, 20, 3, 33, 47, 1, 12])
    run = run_generation(model_dir, prompts, greedy_params(16), block_size=4, dtype="bfloat16")
    identical = 0
    for prompt, got in zip(prompts, run.outputs):
        want = hf_bf16_greedy(model_dir, tuple(prompt), 16)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            assert got == want
            identical += 1
            continue
        logits = _hf_bf16_logits(model_dir, prompt + want[:first])
        top = float(logits[want[first]])
        # within 2 ulps either way: transformers' own full forward may even rank our token
        # first (its KV-cached generate and its full forward round differently)
        gap = top - float(logits[got[first]])
        assert abs(gap) <= 2 * bf16_ulp(top), (
            f"prompt {prompt[:4]}..: token {first} is {got[first]}, transformers' {want[first]} "
            f"leads by {gap} (bf16 ulp {bf16_ulp(top)}): not a tie"
        )
    assert identical >= len(prompts) // 2  # seen here: 5 or 6 of 7 whole continuations equal


def test_last_layer_computes_only_the_sampled_rows(tiny_llama_dir):
    """Past its attention, the last layer runs the rows whose logits are read; a step whose
    every row is read (a pooling request's) runs them all. The logits are the same."""
    runner = ModelRunner(EngineConfig(model=str(tiny_llama_dir), device="cpu"), tiny_llama_dir)
    mlp_rows: list[int] = []
    runner.model.model.layers[-1].mlp.register_forward_hook(
        lambda module, args, out: mlp_rows.append(args[0].shape[0])
    )
    prompts = [[5, 9, 200, 31, 7, 7, 64], [3, 1, 4, 1, 5]]
    tables = [[0], [1]]

    def logits(all_rows: bool) -> torch.Tensor:
        batch = StepBatch(sum(prompts, []), [0, 0], [7, 5], tables, [6, 11])
        batch.all_rows = all_rows
        return runner.forward_batch(batch)

    pruned = logits(False)
    full = logits(True)
    assert mlp_rows == [2, 12]
    torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-5)
    assert pruned.argmax(-1).tolist() == full.argmax(-1).tolist()
