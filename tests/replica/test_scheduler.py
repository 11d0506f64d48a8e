"""Step-by-step scenarios of the scheduler: budgets and seats, chunked prefill, decode,
preemption, prefix caching, eviction order, aborts, stop conditions, rejection and stats."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from replica.config import EngineConfig
from replica.request import Request, RequestStatus, SamplingParams, StepOutput
from replica.scheduler import RequestRejected, ScheduledRequest, Scheduler, SchedulerOutput
from tests.fake_runner import FakeRunner, RunnerCheckError
from tests.helpers import scheduler_request


def make_scheduler(num_blocks: int = 256, max_model_len: int = 4096, **config) -> Scheduler:
    config.setdefault("block_size", 16)
    return Scheduler(EngineConfig(**config), num_blocks, max_model_len)


def prompt(n: int, seed: int) -> list[int]:
    """n tokens no other seed shares (so prefix caching finds nothing unless asked to)."""
    return [seed * 10_000 + i for i in range(n)]


def make_request(
    rid: str, tokens: list[int], max_tokens: int = 16, eos: frozenset[int] = frozenset(), **params
) -> Request:
    return scheduler_request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params), eos)


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.start, s.num_tokens) for s in out.scheduled]


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[StepOutput]]:
    out = sched.schedule()
    sched.kv.check_invariants()
    result = runner.execute(out)
    outputs = sched.update_from_output(out, result.sampled, spec_tokens=result.spec_tokens)
    sched.kv.check_invariants()
    return out, outputs


def run_to_completion(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 1000
) -> dict[str, tuple[list[int], str]]:
    """Step until every request ends; returns {request_id: (output tokens, finish reason)}."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        _, outputs = step(sched, runner)
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not sched.has_unfinished(), f"not done after {max_steps} steps"
    return {rid: (tokens[rid], reasons[rid]) for rid in reasons}


def alone(runner: FakeRunner, request: Request, max_model_len: int) -> tuple[list[int], str]:
    return runner.generate_alone(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        request.eos_token_ids,
        max_model_len,
    )


def final(request: Request) -> tuple[list[int], str | None]:
    return request.output_token_ids, request.status.finish_reason


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.kv.req_to_blocks == {}


# -- budgets, seats, chunking ------------------------------------------------------------------
def test_three_800_token_prompts_are_chunked_into_a_1024_token_budget():
    sched = make_scheduler(max_num_batched_tokens=1024)
    runner = FakeRunner(block_size=16)
    for i, rid in enumerate("ABC"):
        sched.add_request(make_request(rid, prompt(800, i), max_tokens=100))

    out, outputs = step(sched, runner)
    assert chunks(out) == [("A", 0, 800), ("B", 0, 224)]
    assert [o.request_id for o in outputs] == ["A"]  # B's chunk does not reach its end
    assert sched.kv.block_ids("A") == list(range(50))
    assert sched.kv.block_ids("B") == list(range(50, 64))
    assert [r.request_id for r in sched.waiting] == ["C"]

    out, outputs = step(sched, runner)
    assert chunks(out) == [("A", 800, 1), ("B", 224, 576), ("C", 0, 447)]
    assert out.total_num_scheduled_tokens == 1024
    assert [o.request_id for o in outputs] == ["A", "B"]

    out, outputs = step(sched, runner)
    assert chunks(out) == [("A", 801, 1), ("B", 800, 1), ("C", 447, 353)]
    assert out.total_num_scheduled_tokens == 355
    assert [o.request_id for o in outputs] == ["A", "B", "C"]

    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 802, 1), ("B", 801, 1), ("C", 800, 1)]


def test_token_budget_is_split_across_prompts_in_arrival_order():
    sched = make_scheduler(max_num_batched_tokens=25)
    runner = FakeRunner(block_size=16)
    for i, rid in enumerate("ABC"):
        sched.add_request(make_request(rid, prompt(10, i)))
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 0, 10), ("B", 0, 10), ("C", 0, 5)]
    assert out.total_num_scheduled_tokens == 25
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 10, 1), ("B", 10, 1), ("C", 5, 5)]


def test_seat_limit_keeps_extra_requests_waiting_until_a_seat_frees():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    runner = FakeRunner(block_size=16)
    sched.add_request(make_request("A", prompt(10, 0), max_tokens=1))
    sched.add_request(make_request("B", prompt(10, 1), max_tokens=5))
    sched.add_request(make_request("C", prompt(10, 2), max_tokens=5))
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 0, 10), ("B", 0, 10)]
    assert [r.request_id for r in sched.waiting] == ["C"]
    # A finished (max_tokens=1) in that step, so C takes its seat now
    out, _ = step(sched, runner)
    assert chunks(out) == [("B", 10, 1), ("C", 0, 10)]
    assert len(sched.running) == 2


def test_decode_schedules_one_token_per_running_request():
    sched = make_scheduler()
    runner = FakeRunner(block_size=16)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt(5 + 7 * i, i), max_tokens=10))
    step(sched, runner)
    for _ in range(3):
        out, outputs = step(sched, runner)
        assert [s.num_tokens for s in out.scheduled] == [1, 1, 1, 1]
        assert all(s.start == s.request.num_tokens - 2 for s in out.scheduled)  # token appended
        assert all(len(o.new_token_ids) == 1 for o in outputs)
        assert len(outputs) == 4


def test_chunked_prefill_off_a_prompt_larger_than_the_remaining_budget_waits():
    sched = make_scheduler(
        max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False
    )
    runner = FakeRunner(block_size=16)
    sched.add_request(make_request("A", prompt(60, 0)))
    sched.add_request(make_request("B", prompt(50, 1)))
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 0, 60)]
    b = sched.waiting[0]
    assert b.request_id == "B" and b.num_computed_tokens == 0
    assert sched.kv.block_ids("B") == []
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 60, 1), ("B", 0, 50)]


def test_long_prefill_token_threshold_caps_every_prefill_chunk():
    sched = make_scheduler(max_num_batched_tokens=1000, long_prefill_token_threshold=100)
    runner = FakeRunner(block_size=16)
    sched.add_request(make_request("A", prompt(250, 0)))
    sched.add_request(make_request("B", prompt(250, 1)))
    expected = [
        [("A", 0, 100), ("B", 0, 100)],
        [("A", 100, 100), ("B", 100, 100)],
        [("A", 200, 50), ("B", 200, 50)],
        [("A", 250, 1), ("B", 250, 1)],
    ]
    for want in expected:
        out, _ = step(sched, runner)
        assert chunks(out) == want


# -- preemption --------------------------------------------------------------------------------
def preemption_scenario() -> tuple[Scheduler, FakeRunner, SchedulerOutput]:
    """Pool of 5 blocks of 4: A (1 block), B (1 block), C (2 blocks) fill 4 of them; in step 2
    A takes the last block, so B must preempt C, the newest. D arrives in between."""
    sched = make_scheduler(
        num_blocks=5, max_model_len=64, block_size=4, enable_prefix_caching=False
    )
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("A", prompt(4, 0), max_tokens=12))
    sched.add_request(make_request("B", prompt(4, 1), max_tokens=12))
    sched.add_request(make_request("C", prompt(8, 2), max_tokens=12))
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 0, 4), ("B", 0, 4), ("C", 0, 8)]
    assert sched.kv.pool.num_free_blocks == 1
    sched.add_request(make_request("D", prompt(2, 3), max_tokens=12))
    out, _ = step(sched, runner)
    return sched, runner, out


def test_preemption_picks_the_newest_running_request_and_requeues_it_at_the_front():
    sched, _, out = preemption_scenario()
    assert out.preempted_request_ids == ["C"]
    assert chunks(out) == [("A", 4, 1), ("B", 4, 1)]
    c = sched.waiting[0]
    assert c.request_id == "C"
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.num_tokens == 9  # its sampled token is kept and will be recomputed
    assert c.num_preemptions == 1
    assert sched.num_preemptions_total == 1
    assert sched.stats().num_preemptions_total == 1
    assert [r.request_id for r in sched.running] == ["A", "B"]
    assert sched.kv.block_ids("C") == []


def test_no_request_is_admitted_in_a_step_where_a_preemption_happened():
    sched, _, out = preemption_scenario()
    # C's two blocks came back and B took one: D (2 tokens) would fit, but must not start
    assert sched.kv.pool.num_free_blocks == 1
    assert "D" not in [s.request_id for s in out.scheduled]
    assert [r.request_id for r in sched.waiting] == ["C", "D"]
    assert sched.requests["D"].status == RequestStatus.WAITING


def test_resumed_request_recomputes_and_finishes_with_the_tokens_it_would_get_alone():
    sched, runner, _ = preemption_scenario()
    requests = dict(sched.requests)
    c = requests["C"]
    resumed = None
    while resumed is None:
        out, _ = step(sched, runner)
        resumed = next((s for s in out.scheduled if s.request is c), None)
    # prefix caching is off: all 9 tokens (prompt + the token sampled before) are recomputed
    assert (resumed.start, resumed.num_tokens) == (0, 9)
    run_to_completion(sched, runner)
    assert c.num_preemptions >= 1
    for rid, request in requests.items():
        assert final(request) == alone(runner, request, 64), rid
    assert_all_blocks_free(sched)


def test_request_that_is_itself_the_newest_preempts_itself_and_is_not_scheduled():
    sched = make_scheduler(num_blocks=3, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("A", prompt(4, 0), max_tokens=4))
    sched.add_request(make_request("B", prompt(4, 1), max_tokens=4))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 4, 1)]
    assert out.preempted_request_ids == ["B"]
    assert [r.request_id for r in sched.waiting] == ["B"]
    assert [r.request_id for r in sched.running] == ["A"]


def test_resumed_request_reuses_its_own_cached_blocks_after_preemption():
    sched = make_scheduler(num_blocks=3, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    a = make_request("A", prompt(4, 0), max_tokens=4)
    b = make_request("B", prompt(4, 1), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # A -> block 0, B -> block 1
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["B"]
    assert sched.kv.pool.blocks[1].block_hash == b.block_hashes[0]  # freed, still cached
    steps = [step(sched, runner)[0] for _ in range(3)]
    # B's hit needs 1 more block besides its own cached one: it waits until A finishes
    assert [chunks(o) for o in steps] == [[("A", 5, 1)], [("A", 6, 1)], [("B", 4, 1)]]
    assert sched.kv.block_ids("B") == [1, 2]
    assert sched.prefix_cache_hits == 4
    run_to_completion(sched, runner)
    assert final(b) == alone(runner, b, 64)
    assert_all_blocks_free(sched)


# -- prefix caching and eviction ---------------------------------------------------------------
def test_prefix_hit_reuses_exactly_the_cached_blocks_of_the_shared_prefix():
    sched = make_scheduler(num_blocks=16, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    shared = prompt(8, 9)
    sched.add_request(make_request("A", [*shared, 1, 2]))
    out, _ = step(sched, runner)
    assert sched.kv.block_ids("A") == [0, 1, 2]
    b = make_request("B", [*shared, 3, 4, 5])
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert chunks(out) == [("A", 10, 1), ("B", 8, 3)]
    assert sched.kv.block_ids("B") == [0, 1, 3]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert b.num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)


def test_prefix_hit_is_capped_at_num_tokens_minus_one():
    sched = make_scheduler(num_blocks=16, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    tokens = prompt(8, 0)
    sched.add_request(make_request("A", tokens, max_tokens=1))
    step(sched, runner)
    assert not sched.has_unfinished()
    sched.add_request(make_request("B", tokens))
    out, _ = step(sched, runner)
    # both blocks are cached, but the last token's logits are needed: only block 0 is a hit
    assert chunks(out) == [("B", 4, 4)]
    assert sched.kv.block_ids("B") == [0, 2]
    assert sched.prefix_cache_hits == 4


def test_prefix_hit_on_a_free_block_takes_it_off_the_free_list():
    sched = make_scheduler(num_blocks=8, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    shared = prompt(4, 0)
    sched.add_request(make_request("A", [*shared, 1], max_tokens=1))
    step(sched, runner)
    pool = sched.kv.pool
    assert pool.num_free_blocks == 8
    sched.add_request(make_request("B", [*shared, 2]))
    step(sched, runner)
    assert sched.kv.block_ids("B")[0] == 0
    assert pool.blocks[0].ref_cnt == 1
    assert 0 not in [blk.block_id for blk in pool.free_queue]
    assert pool.num_free_blocks == 6


def test_freed_blocks_are_evicted_tail_first_least_recently_freed_first():
    sched = make_scheduler(num_blocks=4, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    a = make_request("A", prompt(7, 0), max_tokens=1)
    b = make_request("B", prompt(7, 1), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # A: blocks 0, 1 (finishes); B: blocks 2, 3
    step(sched, runner)  # B finishes
    assert [blk.block_id for blk in sched.kv.pool.free_queue] == [1, 0, 3, 2]
    # freed blocks keep their hash until reused
    assert sched.kv.pool.get_cached_block(a.block_hashes[0]) is sched.kv.pool.blocks[0]
    sched.add_request(make_request("C", prompt(13, 2), max_tokens=1))
    step(sched, runner)
    # C took all four blocks; A's and B's hashes went with them
    assert sched.kv.pool.get_cached_block(a.block_hashes[0]) is None
    assert sched.kv.pool.get_cached_block(b.block_hashes[0]) is None


def test_eviction_order_shows_in_the_block_table_of_the_next_request():
    sched = make_scheduler(num_blocks=4, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("A", prompt(7, 0), max_tokens=1))
    sched.add_request(make_request("B", prompt(7, 1), max_tokens=2))
    step(sched, runner)
    step(sched, runner)
    sched.add_request(make_request("C", prompt(13, 2), max_tokens=2))
    step(sched, runner)
    assert sched.kv.block_ids("C") == [1, 0, 3, 2]


# -- aborts and finishing from outside ---------------------------------------------------------
def test_abort_frees_a_running_requests_blocks_at_once():
    sched = make_scheduler(num_blocks=8, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    a = make_request("A", prompt(10, 0))
    sched.add_request(a)
    step(sched, runner)
    assert sched.kv.pool.num_free_blocks == 5
    assert sched.abort_requests(["A"]) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert_all_blocks_free(sched)
    assert sched.running == [] and not sched.has_unfinished()
    assert sched.abort_requests(["A", "unknown"]) == []
    out = sched.schedule()
    assert out.finished_request_ids == ["A"]
    assert out.is_empty
    assert sched.schedule().finished_request_ids == []


def test_abort_removes_waiting_and_preempted_requests_from_the_queue():
    sched, _, _ = preemption_scenario()
    assert [r.request_id for r in sched.waiting] == ["C", "D"]
    aborted = sched.abort_requests(["C", "D"])
    assert [r.request_id for r in aborted] == ["C", "D"]
    assert list(sched.waiting) == []
    assert [r.status for r in aborted] == [RequestStatus.FINISHED_ABORTED] * 2


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    sched = make_scheduler(num_blocks=8, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("A", prompt(3, 0)))
    sched.add_request(make_request("B", prompt(3, 1)))
    out = sched.schedule()
    sampled = runner.execute(out).sampled
    sched.abort_requests(["A"])
    outputs = sched.update_from_output(out, sampled)
    assert [o.request_id for o in outputs] == ["B"]
    assert sched.kv.block_ids("A") == []
    sched.kv.check_invariants()
    assert [r.request_id for r in sched.running] == ["B"]


def test_finish_requests_from_outside_frees_blocks_with_the_given_status():
    sched = make_scheduler(num_blocks=8, max_model_len=64, block_size=4)
    runner = FakeRunner(block_size=4)
    a = make_request("A", prompt(6, 0))
    sched.add_request(a)
    step(sched, runner)
    sched.finish_requests(["A"], RequestStatus.FINISHED_STOPPED)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert_all_blocks_free(sched)
    assert sched.schedule().finished_request_ids == ["A"]


# -- stop conditions ---------------------------------------------------------------------------
def run_one(request: Request, forced: list[int], max_model_len: int = 64) -> list[StepOutput]:
    sched = make_scheduler(num_blocks=64, max_model_len=max_model_len, block_size=4)
    runner = FakeRunner(block_size=4, forced_tokens={request.request_id: forced})
    sched.add_request(request)
    outputs = []
    while sched.has_unfinished():
        outputs.extend(step(sched, runner)[1])
    assert_all_blocks_free(sched)
    assert request.output_token_ids == [t for o in outputs for t in o.new_token_ids]
    return outputs


def test_eos_stops_the_request():
    request = make_request("A", prompt(5, 0), max_tokens=10, eos=frozenset({2}))
    outputs = run_one(request, [5, 2, 9])
    assert request.output_token_ids == [5, 2]
    assert [o.finish_reason for o in outputs] == [None, "stop"]
    assert outputs[-1].stop_reason is None
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_past_eos_to_max_tokens():
    request = make_request("A", prompt(5, 0), max_tokens=3, eos=frozenset({2}), ignore_eos=True)
    outputs = run_one(request, [5, 2, 9, 4])
    assert request.output_token_ids == [5, 2, 9]
    assert outputs[-1].finish_reason == "length"
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_id_stops_the_request_and_is_the_stop_reason():
    request = make_request("A", prompt(5, 0), max_tokens=10, stop_token_ids=[9, 7])
    outputs = run_one(request, [5, 2, 9, 4])
    assert request.output_token_ids == [5, 2, 9]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", 9)
    assert request.stop_reason == 9


def test_max_tokens_ends_the_request_with_length():
    request = make_request("A", prompt(5, 0), max_tokens=2)
    outputs = run_one(request, [5, 2, 9])
    assert request.output_token_ids == [5, 2]
    assert [o.finish_reason for o in outputs] == [None, "length"]


def test_max_model_len_ends_the_request_with_length():
    request = make_request("A", prompt(10, 0), max_tokens=50)
    outputs = run_one(request, [5, 2, 9, 4], max_model_len=12)
    assert request.max_total_tokens == 12
    assert request.output_token_ids == [5, 2]
    assert outputs[-1].finish_reason == "length"


# -- rejection and validation ------------------------------------------------------------------
def test_prompt_without_room_for_one_new_token_is_rejected_naming_both_lengths():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(RequestRejected, match=r"16 tokens.*max_model_len=16"):
        sched.add_request(make_request("A", prompt(16, 0)))
    assert not sched.has_unfinished() and list(sched.waiting) == []
    sched.add_request(make_request("B", prompt(15, 0)))
    assert [r.request_id for r in sched.waiting] == ["B"]


def test_request_needing_more_blocks_than_the_pool_is_rejected_naming_the_numbers():
    sched = make_scheduler(num_blocks=4, max_model_len=64, block_size=4)
    with pytest.raises(RequestRejected, match=r"17 tokens = 5 KV blocks of 4.* 4 blocks"):
        sched.add_request(make_request("A", prompt(10, 0), max_tokens=7))
    assert not sched.has_unfinished()
    sched.add_request(make_request("B", prompt(10, 0), max_tokens=6))  # 16 tokens: 4 blocks
    assert sched.has_unfinished()


def test_block_check_counts_tokens_only_up_to_max_model_len():
    sched = make_scheduler(num_blocks=4, max_model_len=16, block_size=4)
    request = make_request("A", prompt(10, 0), max_tokens=1000)
    sched.add_request(request)
    assert request.max_total_tokens == 16


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(3, 0)))
    with pytest.raises(ValueError, match="duplicate request id 'A'"):
        sched.add_request(make_request("A", prompt(3, 1)))
    assert len(sched.waiting) == 1


def test_prompt_longer_than_the_budget_without_chunked_prefill_cannot_hang():
    # the config alone cannot see the model's max_model_len; the scheduler must
    config = EngineConfig(block_size=4, max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\).*max_model_len \(64\)"):
        Scheduler(config, 64, 64)
    Scheduler(config, 64, 32)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("block_size", 0),
        ("num_kv_blocks", 0),
        ("kv_cache_memory_fraction", 0.0),
        ("max_model_len", 1),
        ("long_prefill_token_threshold", -1),
        ("tensor_parallel_size", 0),
        ("dtype", "fp8"),
        ("device", "tpu"),
        ("max_num_seq", 4),  # a typo is an error, not a silently ignored setting
    ],
)
def test_engine_config_error_names_the_bad_field(field, value):
    with pytest.raises(ValidationError) as info:
        EngineConfig(**{field: value})
    assert [e["loc"] for e in info.value.errors()] == [(field,)]
    assert field in str(info.value)


def test_engine_config_validates_assignments_too():
    config = EngineConfig()
    with pytest.raises(ValidationError, match="block_size"):
        config.block_size = 0
    assert config.block_size == 16


def test_engine_config_without_chunked_prefill_needs_a_budget_of_max_model_len():
    with pytest.raises(ValidationError, match=r"max_num_batched_tokens \(512\).*\(1024\)"):
        EngineConfig(max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=False)
    EngineConfig(max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False)
    EngineConfig(max_num_batched_tokens=512, max_model_len=1024)


# -- stats -------------------------------------------------------------------------------------
def test_stats_count_queue_lengths_kv_usage_and_prefix_cache_tokens():
    sched = make_scheduler(num_blocks=10, max_model_len=64, block_size=4, max_num_seqs=1)
    runner = FakeRunner(block_size=4)
    shared = prompt(8, 0)
    sched.add_request(make_request("A", shared, max_tokens=2))
    sched.add_request(make_request("B", [*shared, 1, 2]))
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 2, 0.0)
    step(sched, runner)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_usage == pytest.approx(0.2)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8, 0)
    step(sched, runner)  # A decodes its last token into a third block and finishes
    step(sched, runner)  # B: 2 of its blocks are A's
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 0)
    assert stats.kv_usage == pytest.approx(0.3)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert stats.num_preemptions_total == 0


# -- the fake runner's own checks (so a scheduler bug cannot slip past them) -------------------
def test_fake_runner_rejects_a_chunk_that_does_not_start_where_computation_stopped():
    runner = FakeRunner(block_size=4)
    request = make_request("A", prompt(8, 0))
    runner.execute(SchedulerOutput([ScheduledRequest(request, 0, 4, [0])], 4))
    with pytest.raises(RunnerCheckError, match="starts at 5, computed 4"):
        runner.execute(SchedulerOutput([ScheduledRequest(request, 5, 3, [0, 1])], 3))


def test_fake_runner_rejects_a_block_table_that_does_not_fit_the_tokens():
    runner = FakeRunner(block_size=4)
    request = make_request("A", prompt(8, 0))
    with pytest.raises(RunnerCheckError, match="1 blocks for 6 tokens"):
        runner.execute(SchedulerOutput([ScheduledRequest(request, 0, 6, [0])], 6))


def test_fake_runner_rejects_a_prefix_hit_on_a_block_with_other_contents():
    runner = FakeRunner(block_size=4)
    runner.execute(
        SchedulerOutput([ScheduledRequest(make_request("A", prompt(5, 0)), 0, 5, [0, 1])], 5)
    )
    other = make_request("B", prompt(6, 1))
    with pytest.raises(RunnerCheckError, match="block 0 does not hold tokens"):
        runner.execute(SchedulerOutput([ScheduledRequest(other, 4, 2, [0, 2])], 2))


def test_fake_runner_samples_only_chunks_that_reach_the_end():
    runner = FakeRunner(block_size=4, forced_tokens={"A": [42]})
    request = make_request("A", prompt(6, 0))
    assert runner.execute(SchedulerOutput([ScheduledRequest(request, 0, 4, [0])], 4)).sampled == {}
    sampled = runner.execute(SchedulerOutput([ScheduledRequest(request, 4, 2, [0, 1])], 2)).sampled
    assert sampled == {"A": 42}


# -- the priority policy -----------------------------------------------------------------------
def prio_request(rid: str, seed: int, priority: int, n: int = 4, max_tokens: int = 8) -> Request:
    request = make_request(rid, prompt(n, seed), max_tokens=max_tokens)
    request.priority = priority
    return request


def test_a_waiting_request_of_higher_priority_takes_a_seat_from_the_lowest_running_one():
    """vLLM cannot do this once max_num_seqs is reached (its issue 40004): here the urgent
    request runs in the very next step, the preempted one keeps its place ahead of later
    arrivals of its priority, and every request ends with the tokens it would get alone."""
    sched = make_scheduler(max_num_seqs=2, max_model_len=64, scheduling_policy="priority")
    runner = FakeRunner(block_size=16)
    low_a, low_b = prio_request("low-a", 0, 5), prio_request("low-b", 1, 5)
    sched.add_request(low_a)
    sched.add_request(low_b)
    step(sched, runner)
    late_low = prio_request("late-low", 2, 5)
    urgent = prio_request("urgent", 3, 0)
    sched.add_request(late_low)
    sched.add_request(urgent)
    assert [r.request_id for r in sched.waiting] == ["urgent", "late-low"]
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["low-b"]  # the lowest priority, the newest among equals
    assert ("urgent", 0, 4) in chunks(out)
    assert [r.request_id for r in sched.waiting] == ["low-b", "late-low"]  # kept its place
    requests = [low_a, low_b, late_low, urgent]
    run_to_completion(sched, runner)
    for request in requests:
        assert final(request) == alone(runner, request, 64), request.request_id
    assert_all_blocks_free(sched)


def test_equal_priorities_never_preempt_for_a_seat():
    sched = make_scheduler(max_num_seqs=1, max_model_len=64, scheduling_policy="priority")
    runner = FakeRunner(block_size=16)
    sched.add_request(prio_request("first", 0, 1))
    step(sched, runner)
    sched.add_request(prio_request("second", 1, 1))
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == [] and chunks(out) == [("first", 4, 1)]


def test_fcfs_policy_keeps_arrival_order_whatever_the_priority():
    sched = make_scheduler(max_num_seqs=1, max_model_len=64, scheduling_policy="fcfs")
    runner = FakeRunner(block_size=16)
    sched.add_request(prio_request("first", 0, 9))
    step(sched, runner)
    sched.add_request(prio_request("urgent", 1, 0))
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == [] and chunks(out) == [("first", 4, 1)]


def test_a_higher_priority_request_takes_kv_blocks_from_a_lower_one():
    # 4 blocks of 4 tokens: two low-priority requests hold 2 each; the urgent one needs 2
    sched = make_scheduler(
        num_blocks=4, max_model_len=64, block_size=4, scheduling_policy="priority"
    )
    runner = FakeRunner(block_size=4)
    lows = [prio_request(f"low-{i}", i, 3, n=7, max_tokens=4) for i in range(2)]
    for request in lows:
        sched.add_request(request)
    step(sched, runner)
    urgent = prio_request("urgent", 9, 1, n=6, max_tokens=2)
    sched.add_request(urgent)
    out, _ = step(sched, runner)
    assert "urgent" in [s.request_id for s in out.scheduled]
    assert out.preempted_request_ids  # blocks came from a low-priority request
    assert all(rid.startswith("low") for rid in out.preempted_request_ids)
    run_to_completion(sched, runner)
    for request in [*lows, urgent]:
        assert final(request) == alone(runner, request, 64), request.request_id
    assert_all_blocks_free(sched)


def test_a_victim_already_scheduled_in_the_step_is_taken_back_out_of_it():
    """The running phase needs blocks for a high-priority request that sits after a
    low-priority one in the running list: the low one, scheduled earlier in the same step, is
    preempted and removed from the step, and its budget given back."""
    sched = make_scheduler(
        num_blocks=4, max_model_len=64, block_size=4, scheduling_policy="priority"
    )
    runner = FakeRunner(block_size=4)
    low = prio_request("low", 0, 7, n=3, max_tokens=8)
    sched.add_request(low)
    step(sched, runner)  # low: 3 prompt tokens in block 1, then its first output token
    high = prio_request("high", 1, 0, n=8, max_tokens=4)
    sched.add_request(high)
    step(sched, runner)  # low decodes into block 1; high's prompt takes blocks 2 and 3
    assert [r.request_id for r in sched.running] == ["low", "high"]
    # low's next token takes the last free block; high's needs one more: low gives its back
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["low"]
    assert chunks(out) == [("high", 8, 1)]
    assert out.total_num_scheduled_tokens == 1
    run_to_completion(sched, runner)
    for request in (low, high):
        assert final(request) == alone(runner, request, 64), request.request_id
    assert_all_blocks_free(sched)


def test_a_victim_whose_block_was_hit_in_the_same_step_is_not_preempted_in_it():
    """Priority policy: V's decode fills a block in this step (cached at allocation); H1,
    admitted in the same step, hits it. H2 then wants V's seat. Preempting V now would leave
    the block H1 reads unwritten, so H2 waits a step; every request gets its solo tokens."""
    sched = make_scheduler(block_size=2, max_num_seqs=2, scheduling_policy="priority")
    runner = FakeRunner(2, forced_tokens={"V": [7] * 8})
    sched.add_request(
        scheduler_request("V", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), priority=2)
    )
    step(sched, runner)  # V's prompt; it samples 7
    h1 = scheduler_request(
        "H1", [1, 2, 3, 7, 5], SamplingParams(max_tokens=3, ignore_eos=True), priority=0
    )
    h2 = scheduler_request(
        "H2", [9, 9, 9], SamplingParams(max_tokens=3, ignore_eos=True), priority=1
    )
    sched.add_request(h1)
    sched.add_request(h2)
    out, outputs = step(sched, runner)
    first = {o.request_id: o.new_token_ids for o in outputs}
    assert [s.request_id for s in out.scheduled] == ["V", "H1"]
    assert out.preempted_request_ids == [] and h1.num_cached_tokens == 4  # the in-flight block
    done = run_to_completion(sched, runner)
    assert sched.num_preemptions_total == 1  # V, a step later, once its block was written
    for request in (h1, h2):
        alone = runner.generate_alone(
            request.request_id, request.prompt_token_ids, request.sampling_params, [], 4096
        )
        tokens, reason = done[request.request_id]
        assert (first.get(request.request_id, []) + tokens, reason) == alone
