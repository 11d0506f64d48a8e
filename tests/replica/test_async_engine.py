"""AsyncEngine: the background step loop, one async stream of deltas per request, abort, and
merging of the deltas a slow consumer leaves queued."""

from __future__ import annotations

import asyncio
import time

import pytest

from replica.config import EngineConfig
from replica.engine import LLM, AsyncEngine, Engine
from replica.request import EngineOverloaded, RequestOutput, SamplingParams
from tests.helpers import engine_request
from tests.replica.test_model_parity import mixed_prompts

NUM_STREAMS = 16


def engine_config(model_dir, **fields) -> EngineConfig:
    fields = {"device": "cpu", "block_size": 4, "num_kv_blocks": 256, **fields}
    return EngineConfig(model=str(model_dir), **fields)


def run_async(engine: Engine, body):
    async def main():
        async_engine = AsyncEngine(engine)
        try:
            return await asyncio.wait_for(body(async_engine), timeout=120)
        finally:
            async_engine.shutdown()

    return asyncio.run(main())


async def collect(stream) -> tuple[list[int], str, int, str | None]:
    tokens, text, deltas, reason = [], "", 0, None
    async for out in stream:
        tokens += out.new_token_ids
        text += out.new_text
        deltas += 1
        reason = out.finish_reason
    return tokens, text, deltas, reason


def test_request_output_merge_concatenates_deltas_and_keeps_the_latest_state():
    a = RequestOutput("r", [1], "a", 3, 1, new_logprobs=[(-0.5, {1: -0.5})])
    b = RequestOutput("r", [2, 3], "bc", 3, 3, finish_reason="length", num_cached_tokens=2)
    merged = a.merge(b)
    assert merged.new_token_ids == [1, 2, 3] and merged.new_text == "abc"
    assert merged.num_output_tokens == 3 and merged.finished
    assert merged.finish_reason == "length" and merged.num_cached_tokens == 2
    assert merged.new_logprobs == [(-0.5, {1: -0.5})]
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(RequestOutput("other", [], "", 3, 0))


def test_16_concurrent_streams_match_the_offline_engine(tiny_llama_dir):
    prompts = mixed_prompts(3, [4 + 3 * i for i in range(NUM_STREAMS)])
    lengths = [5 + (i * 7) % 13 for i in range(NUM_STREAMS)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    offline = LLM(model=str(tiny_llama_dir), device="cpu", block_size=4, num_kv_blocks=256)
    expected = [r.output_token_ids for r in offline.generate(prompts, params)]

    async def body(async_engine: AsyncEngine):
        return await asyncio.gather(
            *(
                collect(async_engine.generate(engine_request(p, sp)))
                for p, sp in zip(prompts, params)
            )
        )

    results = run_async(Engine(engine_config(tiny_llama_dir)), body)
    assert [r[0] for r in results] == expected
    assert all(r[3] == "length" for r in results)


def test_abort_mid_stream_frees_the_requests_blocks_at_once(tiny_llama_dir):
    engine = Engine(engine_config(tiny_llama_dir))
    pool = engine.scheduler.kv.pool
    total = pool.num_free_blocks

    async def body(async_engine: AsyncEngine):
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        stream = async_engine.generate(engine_request(list(range(3, 40)), params))
        got = 0
        async for out in stream:
            got += len(out.new_token_ids)
            if got >= 3:
                break
        held = total - pool.num_free_blocks
        await stream.aclose()  # leaving the stream aborts the request
        deadline = time.monotonic() + 5
        while pool.num_free_blocks != total and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return held, got

    held, got = run_async(engine, body)
    assert got >= 3 and held >= 10  # 37 prompt tokens in blocks of 4
    assert pool.num_free_blocks == total
    assert not engine.has_unfinished()


def test_a_slow_consumer_gets_queued_deltas_merged_and_loses_nothing(tiny_llama_dir):
    prompt = list(range(3, 20))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    offline = LLM(model=str(tiny_llama_dir), device="cpu", block_size=4, num_kv_blocks=256)
    expected = offline.generate([prompt], params)[0]

    async def body(async_engine: AsyncEngine):
        tokens, text, deltas = [], "", 0
        async for out in async_engine.generate(engine_request(prompt, params)):
            tokens += out.new_token_ids
            text += out.new_text
            deltas += 1
            await asyncio.sleep(0.05)  # far slower than a step of the tiny model
        return tokens, text, deltas

    tokens, text, deltas = run_async(Engine(engine_config(tiny_llama_dir)), body)
    assert tokens == expected.output_token_ids and text == expected.text
    assert deltas < len(tokens)


def test_a_burst_within_one_step_fills_seats_and_queue_then_is_refused(tiny_llama_dir):
    """max_num_seqs + max_queue_len requests arriving together are all admitted (the first
    max_num_seqs take seats; they are not counted as waiting); one more gets a clear overload."""
    config = engine_config(tiny_llama_dir, max_num_seqs=2, max_queue_len=3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def body(async_engine: AsyncEngine):
        streams = [async_engine.generate(engine_request([3 + i, 4, 5], params)) for i in range(6)]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        admitted = [f for f in firsts if isinstance(f, RequestOutput)]
        refused = [f for f in firsts if isinstance(f, BaseException)]
        for s in streams:
            await s.aclose()
        return admitted, refused

    admitted, refused = run_async(Engine(config), body)
    assert len(admitted) == 5, refused
    assert len(refused) == 1 and isinstance(refused[0], EngineOverloaded)
    assert "3 waiting >= max_queue_len=3" in str(refused[0])
