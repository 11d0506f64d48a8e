"""Hybrid models' KV groups (replica/kv_groups.py, kv_hybrid.py): which layers share a table,
a windowed group freeing its blocks behind its window while the full group keeps all, prefix
hits that need only a window's blocks there, and the memory a long conversation on a
Gemma-3-shaped model holds against the same without a window."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from replica.kv_groups import kv_groups
from replica.kv_hybrid import HybridKVCacheManager
from tests.helpers import scheduler_request
from tests.replica.test_model_parity import expected_outputs, greedy_params, mixed_prompts


def test_groups_of_equal_layer_counts_share_cache_tensors():
    w = 8
    dense = kv_groups([None] * 4)
    assert dense.windows == (None,) and dense.layer_slot == (0, 1, 2, 3) and not dense.hybrid
    assert kv_groups([w] * 3).windows == (w,)  # all windowed: one group, as before
    gemma2 = kv_groups([w, None, w, None])
    assert gemma2.windows == (None, w) and gemma2.num_slots == 2
    assert gemma2.layer_group == (1, 0, 1, 0) and gemma2.layer_slot == (0, 0, 1, 1)
    gemma3 = kv_groups([w] * 5 + [None])
    assert gemma3.windows == (None,) + (w,) * 5 and gemma3.num_slots == 1
    assert gemma3.layer_group == (1, 2, 3, 4, 5, 0)


def test_windowed_group_frees_behind_its_window_and_hits_need_only_the_window():
    kv = HybridKVCacheManager(40, 4, True, (None, 6))
    request = scheduler_request("r", list(range(3, 23)), greedy_params(8))
    request.update_block_hashes(4)
    assert len(kv.allocate_slots(request, 20)) == 10  # 5 blocks in each group
    before = list(kv.group_block_ids("r")[0])
    request.num_computed_tokens = 20
    request.all_token_ids.append(99)
    kv.allocate_slots(request, 1)
    full, windowed = kv.block_ids("r"), kv.group_block_ids("r")[0]
    assert 0 not in full[1:] and windowed[:3] == [0, 0, 0] and len(full) == len(windowed) == 6
    assert kv.num_held_blocks("r") == 6 + 3 and kv.num_window_freed_blocks == 3
    kv.check_invariants()
    # a twin prompt: 4 blocks hit (the last token is computed); the windowed group needs the
    # blocks position 16's window reaches (11..16: blocks 2, 3): block 2 was freed but keeps
    # its hash and data until reused, so it is found
    twin = scheduler_request("t", list(range(3, 23)), greedy_params(8))
    twin.update_block_hashes(4)
    hits, tokens = kv.get_computed_blocks(twin)
    assert tokens == 16 and [b.block_id for b in hits[0]] == full[:4]
    assert hits[1][:2] == [None, None] and [b.block_id for b in hits[1][2:]] == before[2:4]
    kv.allocate_slots(twin, 4, hits)
    kv.check_invariants()
    kv.free(request)
    kv.free(twin)
    kv.check_invariants()
    # all freed; one window block evicted: the hit shrinks to what the window still finds
    kv.pool.uncache_block(kv.pool.get_cached_block(twin.block_hashes[3], 1))
    assert kv.get_computed_blocks(twin)[1] == 12


def test_allocation_is_all_or_nothing_across_groups():
    kv = HybridKVCacheManager(9, 4, False, (None, 4, 4))
    request = scheduler_request("r", list(range(3, 19)), greedy_params(1))
    assert kv.allocate_slots(request, 16) is None  # 4 blocks in each of 3 groups > 9
    assert kv.pool.num_free_blocks == 9 and kv.groups[0].req_to_blocks == {}


@pytest.fixture(scope="module")
def gemma3_w64_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from replica.tiny_models_gemma import build_tiny_gemma

    out = tmp_path_factory.mktemp("tiny-gemma3-w64")
    build_tiny_gemma(
        out, tiny_tokenizer_dir, "gemma3", seed=11, sliding_window=64, max_position_embeddings=4096
    )
    return out


def test_a_long_conversation_on_gemma3_holds_a_fraction_of_the_dense_blocks(gemma3_w64_dir):
    """2,048 tokens (a 1,900-token prompt in chunks of 64, 148 generated) on a Gemma-3-shaped
    model (five layers of window 64, one global): KV held at peak, in one layer's blocks of
    16 tokens, against the same conversation with one table for every layer (as without the
    groups: every block of all six layers); tokens are transformers' own."""
    from replica.config import EngineConfig
    from replica.runner import ModelRunner
    from replica.scheduler import Scheduler

    fields = dict(block_size=16, num_kv_blocks=400, max_num_batched_tokens=64)
    config = EngineConfig(model=str(gemma3_w64_dir), device="cpu", **fields)
    runner = ModelRunner(config, gemma3_w64_dir)
    assert runner.kv_group_windows == (None,) + (64,) * 5 and runner.kv_groups.num_slots == 1
    prompt = mixed_prompts(12, [1900])[0]

    def run(windows, tokens=None):
        scheduler = Scheduler(config, 400, runner.max_model_len, None, windows)
        scheduler.add_request(scheduler_request("long", prompt, greedy_params(148)))
        out, peak = [], 0
        while scheduler.has_unfinished():
            so = scheduler.schedule()
            peak = max(peak, scheduler.kv.pool.num_blocks - scheduler.kv.pool.num_free_blocks)
            if tokens is None:
                sampled = runner.execute(so).sampled
            else:  # replay: the block count does not depend on the model
                sampled = {s.request_id: tokens[len(out)] for s in so.scheduled if s.sample}
            for step in scheduler.update_from_output(so, sampled):
                out += step.new_token_ids
            scheduler.kv.check_invariants()
        return out, peak

    hybrid, peak_hybrid = run(runner.kv_group_windows)
    _, peak_dense = run((), hybrid)
    layers = runner.num_layers
    hybrid_layer_blocks = peak_hybrid * runner.kv_groups.num_slots
    dense_layer_blocks = peak_dense * layers
    print(
        f"\nKV held at peak, 2048 tokens, in one layer's blocks of 16: Gemma-3 5:1 window 64 "
        f"{hybrid_layer_blocks} ({peak_hybrid} group blocks), one table {dense_layer_blocks} "
        f"({peak_dense} blocks x {layers} layers)"
    )
    assert peak_dense == math.ceil(2047 / 16)
    # the global layer's every block, and each windowed layer's window and one chunk
    assert peak_hybrid <= peak_dense + 5 * 10
    assert hybrid_layer_blocks * 4 < dense_layer_blocks
    assert hybrid == expected_outputs(gemma3_w64_dir, [prompt], [148])[0]
