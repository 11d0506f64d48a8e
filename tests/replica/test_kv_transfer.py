"""KV blocks moved between replicas (replica/kv_transfer.py): a source engine exports the leading
run of a prompt's blocks it holds, a target imports them (staged in its host tier, restored at
admission as prefix-cache hits), and its greedy fp32 outputs are token-identical to a recompute;
a partial run (the source evicted some), another layout (dtype, block size, tp), a chain that is
not the prompt's all import only what would equal a recompute (or nothing); tp=2 ranks move
their own shares; the engine core in its own process does the same through its calls."""

from __future__ import annotations

import pickle

import pytest

from replica.config import EngineConfig
from replica.engine import Engine
from replica.kv_transfer import KVExport, measure_engine, prompt_block_hashes
from replica.request import SamplingParams
from tests.replica.test_model_parity import mixed_prompts

BLOCK = 4
PROMPTS = mixed_prompts(21, [37, 29, 45])
MAX_TOKENS = 8


def make_engine(model_dir, **fields) -> Engine:
    fields = {"device": "cpu", "dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 128,
              "max_model_len": 256, **fields}  # fmt: skip
    return Engine(EngineConfig(model=str(model_dir), **fields))


def generate(engine: Engine, prompt, tag: str) -> list[int]:
    engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def hashes_of(prompt, n=None):
    return prompt_block_hashes(prompt, BLOCK, None, n if n is not None else len(prompt) // BLOCK)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tiny_llama_dir, tiny_qwen2_dir):
    """(model dir, source engine that ran every prompt, recomputed outputs)."""
    model_dir = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    source = make_engine(model_dir)
    recomputed = [generate(source, p, f"src-{i}") for i, p in enumerate(PROMPTS)]
    yield model_dir, source, recomputed
    source.shutdown()


@pytest.fixture
def target(family):
    engine = make_engine(family[0])
    yield engine
    engine.shutdown()


def test_imported_prefix_equals_recompute(family, target):
    _, source, recomputed = family
    for i, prompt in enumerate(PROMPTS):
        expected = hashes_of(prompt)
        export = source.export_kv(expected)
        assert export.hashes == expected and export.nbytes > 0
        result = target.import_kv(export, expected)
        assert result.refused is None and result.imported == len(expected)
        before = target.stats()
        assert generate(target, prompt, f"t-{i}") == recomputed[i]
        after = target.stats()
        # every full block but the last position's comes from the import, none recomputed
        hit = (len(prompt) - 1) // BLOCK * BLOCK
        assert after.kv_tier_hit_tokens - before.kv_tier_hit_tokens == hit
        assert after.prefix_cache_hits - before.prefix_cache_hits == hit
        target.scheduler.kv.check_invariants()


def test_partial_export_after_the_source_evicted_midway(family, target):
    """The source lost a middle block: it sends the run before it, the target imports that
    and recomputes the rest; the output is the same."""
    model_dir, _, recomputed = family
    source = make_engine(model_dir)
    try:
        prompt = PROMPTS[2]
        generate(source, prompt, "own")
        expected = hashes_of(prompt)
        pool = source.scheduler.kv.pool
        pool.uncache_block(pool.get_cached_block(expected[5]))
        export = source.export_kv(expected)
        assert export.hashes == expected[:5]
        result = target.import_kv(export, expected)
        assert result.imported == 5
        assert generate(target, prompt, "t") == recomputed[2]
        assert target.stats().kv_tier_hit_tokens == 5 * BLOCK
    finally:
        source.shutdown()


def test_partial_fetch_of_fewer_blocks(family, target):
    _, source, recomputed = family
    prompt = PROMPTS[0]
    expected = hashes_of(prompt, 3)
    result = target.import_kv(source.export_kv(expected), expected)
    assert result.imported == 3
    assert generate(target, prompt, "t") == recomputed[0]
    assert target.stats().kv_tier_hit_tokens == 3 * BLOCK


def test_layout_mismatch_or_foreign_chain_imports_nothing(family, target):
    model_dir, source, recomputed = family
    prompt = PROMPTS[1]
    expected = hashes_of(prompt)
    export = source.export_kv(expected)
    bad = KVExport({**export.layout, "dtype": "bfloat16"}, export.hashes, export.data)
    assert target.import_kv(bad, expected).refused == "layout"
    other = hashes_of(PROMPTS[0])  # another prompt's chain
    result = target.import_kv(export, other)
    assert result.refused == "chain" and result.imported == 0
    # a different block size is another layout (its blocks hold other tokens)
    big = make_engine(model_dir, block_size=8)
    try:
        result = big.import_kv(export, prompt_block_hashes(prompt, 8, None, 4))
        assert result.refused == "layout" and result.imported == 0
        assert big.stats().kv_tier_blocks == 0
    finally:
        big.shutdown()
    assert target.stats().kv_tier_blocks == 0
    assert generate(target, prompt, "t") == recomputed[1]
    assert target.stats().kv_tier_hit_tokens == 0


def test_transfer_off_exports_and_imports_nothing(family):
    model_dir, source, _ = family
    off = make_engine(model_dir, kv_transfer=False)
    try:
        expected = hashes_of(PROMPTS[0])
        assert off.export_kv(expected).hashes == []
        assert off.import_kv(source.export_kv(expected), expected).refused == "off"
    finally:
        off.shutdown()


def test_export_reaches_into_the_source_tier(tiny_llama_dir):
    """Blocks the source evicted to its host tier are exported too (and equal a recompute)."""
    probe = make_engine(tiny_llama_dir, num_kv_blocks=4)
    per_block = probe.kv_layout["block_bytes"]
    probe.shutdown()
    source = make_engine(tiny_llama_dir, num_kv_blocks=16, kv_offload_bytes=64 * per_block)
    target = make_engine(tiny_llama_dir)
    try:
        recomputed = [generate(source, p, f"s-{i}") for i, p in enumerate(PROMPTS)]
        expected = hashes_of(PROMPTS[0])  # evicted by the later prompts
        assert source.scheduler.kv.pool.get_cached_block(expected[0]) is None
        export = source.export_kv(expected)
        assert export.hashes == expected
        assert target.import_kv(export, expected).imported == len(expected)
        assert generate(target, PROMPTS[0], "t") == recomputed[0]
    finally:
        source.shutdown()
        target.shutdown()


def test_measure_engine_costs(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    try:
        costs = measure_engine(engine)
        assert costs["prefill_tokens_per_s"] > 0 and costs["kv_copy_bytes_per_s"] > 0
        assert costs["kv_bytes_per_block"] == engine.kv_layout["block_bytes"]
        # no trace left: no cached block, no counters
        assert not engine.scheduler.kv.pool.cached and engine.stats().prefix_cache_queries == 0
    finally:
        engine.shutdown()


def test_engine_core_process_exports_and_imports(tiny_llama_dir):
    """The same through the core process's calls (CoreOp.KV_EXPORT, KV_IMPORT, KV_MEASURE)."""
    import asyncio

    from replica.engine.core_client import ProcessEngine
    from replica.engine.wire import CoreOp
    from replica.request import EngineRequest

    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                          block_size=BLOCK, num_kv_blocks=128, max_model_len=256)  # fmt: skip
    prompt = PROMPTS[0]
    expected = hashes_of(prompt)

    async def run(engine, rid):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        tokens = []
        async for out in engine.generate(EngineRequest(prompt, params, rid)):
            tokens += out.new_token_ids
        return tokens

    async def main():
        source = ProcessEngine(config, num_threads=1)
        target = ProcessEngine(config, num_threads=1)
        try:
            costs = source.call(CoreOp.KV_MEASURE).result(timeout=60)
            assert costs["prefill_tokens_per_s"] > 0
            want = await run(source, "s")
            export = source.call(CoreOp.KV_EXPORT, None, pickle.dumps(expected)).result(60)
            assert export.hashes == expected
            blob = pickle.dumps((export, expected))
            result = target.call(CoreOp.KV_IMPORT, None, blob).result(timeout=60)
            assert result.imported == len(expected)
            assert await run(target, "t") == want
            await asyncio.sleep(0.1)
            assert target.stats().kv_tier_hit_tokens == (len(prompt) - 1) // BLOCK * BLOCK
        finally:
            source.shutdown()
            target.shutdown()

    asyncio.run(main())


def test_tp2_tier_and_transfer_move_every_rank_share(tiny_llama_dir):
    """tp=2 (gloo, a local worker process): the tier's moves ride the step channel to rank 1,
    an export gathers both ranks' shares, an import scatters them; outputs equal tp=1's
    recompute. A tp=2 export is another layout to a tp=1 engine. (One tensor-parallel group per
    process at a time: the source and the target run one after the other.)"""
    single = make_engine(tiny_llama_dir)
    recomputed = [generate(single, p, f"r-{i}") for i, p in enumerate(PROMPTS)]
    per_block_tp1 = single.kv_layout["block_bytes"]
    expected = hashes_of(PROMPTS[0])
    # tp=2: each rank holds half the KV heads, so a block is half the bytes
    source = make_engine(tiny_llama_dir, tensor_parallel_size=2, num_kv_blocks=16,
                         kv_offload_bytes=64 * per_block_tp1)  # fmt: skip
    try:
        first = [generate(source, p, f"a-{i}") for i, p in enumerate(PROMPTS)]
        assert first == recomputed
        assert source.stats().kv_tier_saves > 0
        assert generate(source, PROMPTS[0], "again") == recomputed[0]  # restored on both ranks
        assert source.stats().kv_tier_hit_tokens > 0
        export = source.export_kv(expected)
        assert export.hashes == expected and len(export.data) == 2
        assert export.layout["tp_size"] == 2
    finally:
        source.shutdown()
    refused = single.import_kv(export, expected)
    single.shutdown()
    assert refused.refused == "layout"
    target = make_engine(tiny_llama_dir, tensor_parallel_size=2)
    try:
        assert target.import_kv(export, expected).imported == len(expected)
        assert generate(target, PROMPTS[0], "t") == recomputed[0]
        assert target.stats().kv_tier_hit_tokens == (len(PROMPTS[0]) - 1) // BLOCK * BLOCK
    finally:
        target.shutdown()
