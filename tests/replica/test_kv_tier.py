"""The KV tiers below the pool (replica/kv_tier.py): with a pool smaller than the working set,
blocks evicted from it are saved to host memory (and disk), a second pass over the same prompts
finds them there instead of recomputing, and its greedy fp32 outputs equal a recompute's; the
index keeps its LRU byte limits and emits every move as an op."""

from __future__ import annotations

import pytest

from replica.config import EngineConfig
from replica.engine import Engine
from replica.kv_tier import DEMOTE, DROP, RESTORE, SAVE, KVTierIndex
from replica.request import SamplingParams
from tests.replica.test_model_parity import mixed_prompts

BLOCK = 4


def make_engine(model_dir, **fields) -> Engine:
    fields = {"device": "cpu", "dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 256,
              "max_model_len": 256, "max_num_seqs": 4, **fields}  # fmt: skip
    return Engine(EngineConfig(model=str(model_dir), **fields))


def generate(engine: Engine, prompts, max_tokens=6, tag="a") -> list[list[int]]:
    """Greedy outputs, one request at a time (so the pool's LRU order is the prompts')."""
    outs = []
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            engine.scheduler.kv.check_invariants()
        outs.append(tokens)
    return outs


# prompts of 6-9 blocks: the working set (8 prompts) is far larger than a 24-block pool
PROMPTS = mixed_prompts(7, [25, 31, 29, 36, 27, 33, 24, 30])


@pytest.fixture(scope="module")
def recomputed(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    try:
        yield generate(engine, PROMPTS)
    finally:
        engine.shutdown()


def block_bytes(model_dir) -> int:
    engine = make_engine(model_dir, num_kv_blocks=4)
    try:
        return engine.kv_layout["block_bytes"]
    finally:
        engine.shutdown()


def test_second_pass_hits_the_host_tier_and_equals_recompute(tiny_llama_dir, recomputed):
    per_block = block_bytes(tiny_llama_dir)
    engine = make_engine(tiny_llama_dir, num_kv_blocks=24, kv_offload_bytes=400 * per_block)
    try:
        first = generate(engine, PROMPTS, tag="first")
        stats = engine.stats()
        assert stats.kv_tier_saves > 0 and stats.kv_tier_hit_tokens == 0
        second = generate(engine, PROMPTS, tag="second")
        stats = engine.stats()
        assert first == recomputed and second == recomputed
        # every full prompt block but the last pool-resident ones comes back from the tier
        assert stats.kv_tier_restores > 0
        assert stats.kv_tier_hit_tokens >= sum(len(p) for p in PROMPTS) // 2
        assert stats.prefix_cache_hits >= stats.kv_tier_hit_tokens
        assert len(engine.runner.kv_tier.host) == stats.kv_tier_blocks
    finally:
        engine.shutdown()


def test_tier_off_and_too_small_tier_change_nothing(tiny_llama_dir, recomputed):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=24, kv_transfer=False)
    try:
        assert engine.scheduler.kv.pool.tier is None
        assert generate(engine, PROMPTS) == recomputed
    finally:
        engine.shutdown()


def test_disk_tier_round_trip(tiny_llama_dir, recomputed, tmp_path):
    """A host tier of 4 blocks spills to disk; the second pass restores from disk too."""
    per_block = block_bytes(tiny_llama_dir)
    engine = make_engine(
        tiny_llama_dir,
        num_kv_blocks=24,
        kv_offload_bytes=4 * per_block,
        kv_offload_dir=str(tmp_path),
        kv_offload_disk_bytes=400 * per_block,
        kv_transfer=False,
    )
    try:
        generate(engine, PROMPTS, tag="first")
        tier = engine.scheduler.kv.pool.tier
        assert tier.num_demoted > 0 and len(tier.disk) > 0
        store = engine.runner.kv_tier
        assert len(list(store.disk_dir.iterdir())) == len(store.disk) == len(tier.disk)
        assert generate(engine, PROMPTS, tag="second") == recomputed
        assert engine.stats().kv_tier_hit_tokens > 0
    finally:
        engine.shutdown()
    assert not any(tmp_path.rglob("*.kv")), "the disk tier's files outlived the engine"


def test_index_lru_limits_and_ops():
    index = KVTierIndex(host_blocks=2, disk_blocks=2)
    for h, b in [(10, 1), (11, 2), (12, 3)]:
        index.save(h, b)
    assert list(index.host) == [11, 12] and list(index.disk) == [10]
    assert index.take_ops() == [(SAVE, 10, 1), (SAVE, 11, 2), (SAVE, 12, 3), (DEMOTE, 10, -1)]
    index.save(13, 4)
    index.save(14, 5)  # disk over its limit: its LRU (10) goes
    assert list(index.disk) == [11, 12] and (DROP, 10, -1) in index.take_ops()
    index.save(14, 9)  # held already: nothing
    assert index.take_ops() == []
    # take: the leading run held (host or disk), out of the index until restored/put back
    assert index.take([12, 13, 99, 14]) == [12, 13]
    assert 12 not in index and 13 not in index
    index.put_back([12, 13])
    assert index.where(12) == "disk" and index.where(13) == "host"
    run = index.take([13, 14])
    index.restore(run, [7, 8])
    assert index.take_ops() == [(RESTORE, 13, 7), (RESTORE, 14, 8)]
    assert len(index) == 2


def test_index_without_spill_stages_imports_only():
    index = KVTierIndex(host_blocks=0, staging_blocks=2)
    index.save(1, 1)
    assert len(index) == 0 and index.take_ops() == []
    for h in (5, 6, 7):
        assert index.staged(h)
    assert list(index.host) == [6, 7] and index.take_ops() == [(DROP, 5, -1)]
    assert not KVTierIndex(0, 0, 0).staged(1)


def test_hybrid_model_refuses_tiers(tmp_path_factory, tiny_tokenizer_dir, caplog):
    """A model whose layers form several KV groups (Gemma 2/3) gets no tier, with a log line."""
    from replica.tiny_models_gemma import build_tiny_gemma

    model_dir = tmp_path_factory.mktemp("tiny-gemma3-tier")
    build_tiny_gemma(
        model_dir, tiny_tokenizer_dir, "gemma3", seed=11, sliding_window=64,
        max_position_embeddings=4096,
    )  # fmt: skip
    with caplog.at_level("INFO"):
        engine = make_engine(model_dir, kv_offload_bytes=1 << 20)
    try:
        assert engine.scheduler.hybrid
        assert engine.scheduler.kv.pool.tier is None and engine.kv_layout is None
        assert "KV tiers and KV transfer are off" in caplog.text
    finally:
        engine.shutdown()


def test_tier_ops_cross_the_step_channel_intact():
    """The ops reach the other tensor-parallel ranks as int32s: any 64-bit hash survives."""
    from replica.parallel.channel import decode_batch, encode_batch
    from replica.runner import StepBatch

    ops = [(SAVE, -(2**63), 3), (RESTORE, 2**63 - 1, 0), (DEMOTE, 0x8000_0000, -1),
           (DROP, -1, -1)]  # fmt: skip
    for batch in (
        StepBatch([], [], [], [], [], kv_ops=ops),
        StepBatch([5, 6], [0], [2], [[1]], [1], lora_slots=[2], kv_ops=ops),
    ):
        back = decode_batch(encode_batch(batch))
        assert back.kv_ops == ops and back.input_ids == batch.input_ids
        assert back.lora_slots == batch.lora_slots and back.block_ids == batch.block_ids


def test_sliding_window_model_tier_equals_recompute(tmp_path_factory, tiny_tokenizer_dir):
    """Mistral with a 16-token window on every layer (blocks behind it are freed while a
    request runs, and can be evicted and saved then): the tier's restored prefixes still give
    a recompute's tokens."""
    from replica.tiny_models import build_tiny_model

    tiny_mistral_dir = tmp_path_factory.mktemp("tiny-mistral-w16")
    build_tiny_model(tiny_mistral_dir, tiny_tokenizer_dir, "mistral", seed=3,
                     tie_word_embeddings=False, sliding_window=16)  # fmt: skip
    per_block = block_bytes(tiny_mistral_dir)
    plain = make_engine(tiny_mistral_dir, enable_prefix_caching=False)
    tiered = make_engine(tiny_mistral_dir, num_kv_blocks=24, kv_offload_bytes=400 * per_block)
    try:
        want = generate(plain, PROMPTS[:5], max_tokens=12)
        generate(tiered, PROMPTS[:5], max_tokens=12, tag="first")
        assert generate(tiered, PROMPTS[:5], max_tokens=12, tag="second") == want
        assert tiered.stats().kv_tier_hit_tokens > 0
        assert tiered.scheduler.kv.num_window_freed_blocks > 0
    finally:
        plain.shutdown()
        tiered.shutdown()
