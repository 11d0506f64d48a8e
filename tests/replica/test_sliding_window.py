"""Sliding-window attention for real: the native decode and prefill kernels attend only a
query's window (and never read the blocks before it) and soft-cap scores, at every instruction-set
level; the KV manager frees the blocks every layer has left behind; a Mistral whose window is far
shorter than its prompts stays token-identical to transformers through chunked prefill, prefix
caching and preemption, while a long conversation holds a fraction of the blocks."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from replica.kv_cache import NULL_BLOCK_ID, KVCacheManager
from replica.layers.cpu_kernels import paged_decode, paged_prefill
from tests.helpers import scheduler_request
from tests.replica.test_cpu_kernels import needs_native, scattered_cache
from tests.replica.test_model_parity import expected_outputs, greedy_params, mixed_prompts


def reference(q, keys, values, positions, first_key, window, cap, scale):
    """q [n, H, d] at `positions` against keys/values [m, Hkv, d] at first_key..: float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    key_pos = torch.arange(first_key, first_key + keys.shape[0])[None, :]
    pos = positions[:, None]
    seen = key_pos <= pos
    if window is not None:
        seen &= key_pos > pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def gathered(cache, table_row, first_key, num_keys, block_size):
    keys = torch.arange(first_key, num_keys)
    return cache[table_row.long()[keys // block_size], keys % block_size]


def with_nan_block(k, v):
    """The caches with one more block, all NaN, and its id."""
    nan = torch.full_like(k[:1], float("nan"))
    return torch.cat([k, nan]), torch.cat([v, nan]), k.shape[0]


def poison_blocks_before(table, row, first_key, block_size, nan_block):
    """Point the row's blocks wholly before `first_key` at a block of NaNs: a kernel that reads
    one returns NaN."""
    for i in range(first_key // block_size):
        table[row, i] = nan_block


@needs_native
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 2, 16, 4), (2, 1, 272, 4)],  # 272: the portable per-sequence path
)
@pytest.mark.parametrize("window,cap", [(5, None), (37, None), (None, 2.0), (11, 3.0)])
def test_decode_kernel_attends_only_the_window_and_soft_caps(
    num_heads, num_kv_heads, head_dim, block_size, window, cap, cpu_isa_level
):
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    lens = [1, 4, 9, 40, 77, 130]
    table, k, v = scattered_cache(
        rng, gen, [-(-n // block_size) for n in lens], 1, 0, block_size, num_kv_heads,
        head_dim, torch.float32,
    )  # fmt: skip
    k, v, nan_block = with_nan_block(k, v)
    for row, n in enumerate(lens):
        if window is not None:
            poison_blocks_before(table, row, max(0, n - window), block_size, nan_block)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = paged_decode(q, k, v, table, seq_lens, scale, 2, sliding_window=window, soft_cap=cap)
    for row, n in enumerate(lens):
        first = 0 if window is None else max(0, n - window)
        want = reference(
            q[row : row + 1], gathered(k, table[row], first, n, block_size),
            gathered(v, table[row], first, n, block_size), torch.tensor([n - 1]), first, window,
            cap, scale,
        )  # fmt: skip
        torch.testing.assert_close(out[row : row + 1].double(), want, rtol=1e-4, atol=1e-5)


@needs_native
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (16, 4), (24, 8)])
@pytest.mark.parametrize("window,cap", [(13, None), (40, 3.0), (None, 2.0), (1, None)])
def test_prefill_kernel_attends_only_the_window_and_soft_caps(
    head_dim, block_size, window, cap, cpu_isa_level
):
    """Whole prompts, chunks after cached context (a prefix hit), one-token spans; the blocks
    wholly before a span's first window are NaN."""
    spans = [(0, 70), (45, 33), (100, 2), (7, 50), (0, 1)]
    num_heads, num_kv_heads = 4, 2
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    table, k, v = scattered_cache(
        rng, gen, [-(-(c + n) // block_size) for c, n in spans], 0, 0, block_size,
        num_kv_heads, head_dim, torch.float32,
    )  # fmt: skip
    k, v, nan_block = with_nan_block(k, v)
    if window is not None:  # no key before the span's first window is read, whatever the tiles
        for row, (ctx, _) in enumerate(spans):
            poison_blocks_before(table, row, max(0, ctx - window + 1), block_size, nan_block)
    lens = torch.tensor([n for _, n in spans], dtype=torch.int32)
    starts = torch.cumsum(lens, 0, dtype=torch.int32) - lens
    ctx = torch.tensor([c for c, _ in spans], dtype=torch.int32)
    q = torch.randn(int(lens.sum()), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = paged_prefill(
        q, k, v, table, starts, lens, ctx, scale, 2, sliding_window=window, soft_cap=cap
    )
    for row, (c, n) in enumerate(spans):
        s = int(starts[row])
        first = 0 if window is None else max(0, c - window + 1)
        want = reference(
            q[s : s + n], gathered(k, table[row], first, c + n, block_size),
            gathered(v, table[row], first, c + n, block_size), torch.arange(c, c + n), first,
            window, cap, scale,
        )  # fmt: skip
        torch.testing.assert_close(out[s : s + n].double(), want, rtol=1e-4, atol=1e-5)


@needs_native
def test_kernel_wrappers_reject_a_bad_window_or_cap():
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(2, 4, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        paged_decode(q, cache, cache, table, lens, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap must be positive"):
        paged_decode(q, cache, cache, table, lens, 1.0, soft_cap=-1.0)


# -- the KV manager ---------------------------------------------------------------------------
def test_blocks_behind_the_window_go_back_to_the_pool():
    """Window 6, blocks of 4: the query at position p needs keys p-5..p, so once 20 tokens are
    computed, blocks 0-2 (positions 0-11, all before 15) are freed and their table entries
    become NULL_BLOCK_ID; the request's later blocks and the pool's books stay consistent."""
    kv = KVCacheManager(12, 4, enable_caching=True, sliding_window=6)
    request = scheduler_request("r", list(range(3, 23)), greedy_params(8))
    request.update_block_hashes(4)
    assert kv.allocate_slots(request, 20) is not None
    held = list(kv.block_ids("r"))
    assert len(held) == 5 and kv.pool.num_free_blocks == 7
    request.num_computed_tokens = 20
    request.all_token_ids.append(99)
    kv.allocate_slots(request, 1)  # 21 tokens: a 6th block
    ids = kv.block_ids("r")
    assert ids[:3] == [NULL_BLOCK_ID] * 3 and ids[3:5] == held[3:5] and len(ids) == 6
    assert kv.num_held_blocks("r") == 3 and kv.pool.num_free_blocks == 9
    assert kv.num_window_freed_blocks == 3
    kv.check_invariants()
    # freed blocks keep their hashes until reused: a prompt with the same prefix hits them
    twin = scheduler_request("t", list(range(3, 23)), greedy_params(8))
    twin.update_block_hashes(4)
    hits, num_tokens = kv.get_computed_blocks(twin)
    assert [b.block_id for b in hits][:3] == held[:3] and num_tokens == 16
    kv.free(request)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 12


def test_without_a_window_every_block_is_kept():
    kv = KVCacheManager(12, 4, enable_caching=False)
    request = scheduler_request("r", list(range(3, 23)), greedy_params(8))
    kv.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    kv.allocate_slots(request, 1)
    assert NULL_BLOCK_ID not in kv.block_ids("r")[1:] and kv.num_held_blocks("r") == 6
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        KVCacheManager(12, 4, sliding_window=0)


# -- Mistral with a window far shorter than its prompts --------------------------------------
@pytest.fixture(scope="module")
def mistral_w8_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from replica.tiny_models import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-mistral-w8")
    build_tiny_model(out, tiny_tokenizer_dir, "mistral", seed=3, sliding_window=8)
    return out


PLAIN_TORCH = dict(cpu_decode_attention="torch", cpu_fused_ops=False, pack_cpu_weights=False)


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_mistral_window_8_matches_transformers_over_chunks_and_prefix_hits(
    mistral_w8_dir, run_generation, path, max_num_batched_tokens
):
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 30)]
    prompts += mixed_prompts(2, [61, 2, 35, 9])
    max_tokens = [9, 6, 11, 8, 12, 7, 10]
    run = run_generation(
        mistral_w8_dir,
        prompts,
        [greedy_params(n) for n in max_tokens],
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=True,
        **(PLAIN_TORCH if path == "torch" else {}),
    )
    assert run.runner.kv_sliding_window == 8 and run.runner.max_model_len == 512
    assert run.scheduler.prefix_cache_hits > 0
    assert run.scheduler.kv.num_window_freed_blocks > 0
    assert run.outputs == expected_outputs(mistral_w8_dir, prompts, max_tokens)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_mistral_window_8_preemption_keeps_outputs_identical(mistral_w8_dir, run_generation, path):
    prompts = mixed_prompts(3, [14, 19, 22, 9, 17, 25, 12, 20])
    run = run_generation(
        mistral_w8_dir,
        prompts,
        greedy_params(16),
        block_size=4,
        num_kv_blocks=14,  # the longest request would hold 11 blocks without the window
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        **(PLAIN_TORCH if path == "torch" else {}),
    )
    assert run.scheduler.num_preemptions_total > 0
    assert run.outputs == expected_outputs(mistral_w8_dir, prompts, [16] * len(prompts))


# -- the memory figure ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mistral_w64_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from replica.tiny_models import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-mistral-w64")
    build_tiny_model(
        out, tiny_tokenizer_dir, "mistral", seed=8, sliding_window=64, max_position_embeddings=4096
    )
    return out


def peak_blocks(model_dir, runner, prompt, max_tokens, window, **fields):
    """(output tokens, the most KV blocks in use at any step) of one request."""
    from replica.config import EngineConfig
    from replica.scheduler import Scheduler

    config = EngineConfig(model=str(model_dir), device="cpu", **fields)
    scheduler = Scheduler(config, config.num_kv_blocks, runner.max_model_len, window)
    scheduler.add_request(scheduler_request("long", prompt, greedy_params(max_tokens)))
    out, peak = [], 0
    while scheduler.has_unfinished():
        so = scheduler.schedule()
        pool = scheduler.kv.pool
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
        result = runner.execute(so)
        for step in scheduler.update_from_output(so, result.sampled):
            out += step.new_token_ids
        scheduler.kv.check_invariants()
    return out, peak


def test_a_long_conversation_holds_a_window_of_blocks(mistral_w64_dir):
    """A 2,048-token conversation (1,900-token prompt in chunks of 64, 148 tokens generated) on
    a Mistral with a 64-token window: the window's blocks and a chunk's are held, not the whole
    context's (128 blocks of 16), and the tokens are transformers' own."""
    from replica.config import EngineConfig
    from replica.runner import ModelRunner

    fields = dict(block_size=16, num_kv_blocks=160, max_num_batched_tokens=64)
    config = EngineConfig(model=str(mistral_w64_dir), device="cpu", **fields)
    runner = ModelRunner(config, mistral_w64_dir)
    prompt = mixed_prompts(12, [1900])[0]
    windowed, peak_windowed = peak_blocks(mistral_w64_dir, runner, prompt, 148, 64, **fields)
    full, peak_full = peak_blocks(mistral_w64_dir, runner, prompt, 148, None, **fields)
    print(
        f"\nKV blocks of 16 held at peak, 2048 tokens: window 64 {peak_windowed}, none {peak_full}"
    )
    assert peak_full == math.ceil(2047 / 16)  # every block of the context (2,047 keys)
    # the window (64 keys: up to 5 blocks unaligned) and one 64-token chunk (up to 5 more)
    assert peak_windowed <= 10
    assert windowed == full == expected_outputs(mistral_w64_dir, [prompt], [148])[0]


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ("mixtral", {"sliding_window": 8}),
        ("qwen3_moe", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0}),
        ("qwen3", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}),
    ],
)
def test_families_with_a_window_shorter_than_the_prompts_match_transformers(
    family, fields, tmp_path, tiny_tokenizer_dir, run_generation
):
    """Windows read per family (models/windows.py): every layer (Mixtral, Qwen3-MoE) or the
    config's layer_types (Qwen3), through chunked prefill and prefix hits."""
    from replica.tiny_models_moe import build_tiny_family

    build_tiny_family(tmp_path, tiny_tokenizer_dir, family, seed=41, **fields)
    prompts = mixed_prompts(3, [21, 34, 9, 40])
    max_tokens = [12, 6, 16, 9]
    run = run_generation(
        tmp_path, prompts, [greedy_params(n) for n in max_tokens], block_size=4,
        max_num_batched_tokens=16, enable_prefix_caching=True,
    )  # fmt: skip
    assert run.outputs == expected_outputs(tmp_path, prompts, max_tokens)


def test_phi3_with_a_window_shorter_than_the_prompts_matches_transformers(
    tmp_path, tiny_tokenizer_dir, run_generation
):
    from replica.tiny_models_phi3_smollm3 import build_tiny_phi3

    build_tiny_phi3(tmp_path, tiny_tokenizer_dir, seed=42, sliding_window=8)
    prompts = mixed_prompts(4, [25, 12, 38])
    max_tokens = [10, 14, 8]
    run = run_generation(
        tmp_path, prompts, [greedy_params(n) for n in max_tokens], block_size=4,
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert run.outputs == expected_outputs(tmp_path, prompts, max_tokens)


def test_a_window_on_a_family_of_unknown_layout_is_refused():
    from types import SimpleNamespace

    from replica.models.windows import layer_windows

    config = SimpleNamespace(
        architectures=["OlmoeForCausalLM"], num_hidden_layers=2, sliding_window=16
    )
    with pytest.raises(ValueError, match="sliding_window=16 on architecture 'OlmoeForCausalLM'"):
        layer_windows(config)
