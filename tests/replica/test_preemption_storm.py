"""Preemption storms (no Ray): a KV pool far smaller than the load, many long requests. Every
request must finish with exactly the tokens it gets when run alone, the engine must make
progress every step (no livelock), preemptions are counted, and no block or request state
outlives the storm."""

from __future__ import annotations

import pytest

from replica.engine import LLM
from replica.request import SamplingParams

BLOCK_SIZE = 8
STORM_BLOCKS = 20  # 160 token slots; the storm below wants ~1,150 at once
NUM_REQUESTS = 12


def storm_requests() -> list[tuple[list[int], SamplingParams]]:
    """Long requests, each fitting the pool alone (<= 15 blocks of 8): greedy ones and seeded
    sampled ones (a seeded request's draws must also survive recomputation)."""
    out = []
    for i in range(NUM_REQUESTS):
        prompt = [(11 * i + 3 * j) % 500 + 3 for j in range(24 + (i * 7) % 17)]
        max_tokens = 48 + (i * 13) % 33
        if i % 3 == 2:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True
            )
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out.append((prompt, params))
    return out


def engine_fields(num_kv_blocks: int, prefix_caching: bool) -> dict:
    return {
        "device": "cpu",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": num_kv_blocks,
        "max_num_seqs": NUM_REQUESTS,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
        "enable_prefix_caching": prefix_caching,
    }


@pytest.fixture(scope="module")
def alone_outputs(tiny_llama_dir) -> list[list[int]]:
    """Each request run by itself in an ample pool: the tokens it must get in the storm too."""
    llm = LLM(tiny_llama_dir, **engine_fields(num_kv_blocks=64, prefix_caching=False))
    try:
        outputs = []
        for prompt, params in storm_requests():
            (result,) = llm.generate([prompt], params)
            assert result.num_preemptions == 0
            outputs.append(result.output_token_ids)
        return outputs
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_preemption_storm_finishes_with_solo_tokens(tiny_llama_dir, alone_outputs, prefix_caching):
    llm = LLM(tiny_llama_dir, **engine_fields(STORM_BLOCKS, prefix_caching))
    engine = llm.engine
    requests = storm_requests()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"storm-{i}", prompt, params)
    # No livelock: preemption always takes the newest running request, so the oldest one
    # advances by >= 1 token every step and keeps its progress; hence the run needs at most one
    # step per token of work (prompt + output) over all requests.
    step_bound = sum(len(prompt) + params.max_tokens for prompt, params in requests)
    tokens: dict[str, list[int]] = {f"storm-{i}": [] for i in range(NUM_REQUESTS)}
    preemptions: dict[str, int] = {}
    steps = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    assert out.finish_reason == "length", out
                    preemptions[out.request_id] = out.num_preemptions
            engine.scheduler.kv.check_invariants()
            steps += 1
            assert steps <= step_bound, f"no progress: {steps} steps > bound {step_bound}"

        scheduler = engine.scheduler
        assert scheduler.num_preemptions_total > 0, "the pool was too large to cause a storm"
        assert sum(preemptions.values()) == scheduler.num_preemptions_total
        for i in range(NUM_REQUESTS):
            rid = f"storm-{i}"
            assert tokens[rid] == alone_outputs[i], f"{rid} (preempted {preemptions[rid]}x)"
        # nothing outlives the storm: every block free, no per-request state anywhere
        pool = scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert not scheduler.requests and not scheduler.running and not scheduler.waiting
        assert not scheduler.kv.req_to_blocks
        assert engine.num_request_states == 0 and not len(engine.output_processor)
    finally:
        llm.shutdown()
