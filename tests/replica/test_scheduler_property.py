"""Property test: random workloads (arrivals, prompt lengths with shared prefixes, max_tokens,
aborts, pool sizes, budgets, block sizes, prefix caching and chunked prefill on or off) driven
through schedule -> fake runner -> update_from_output, checking the scheduler's invariants after
every step and that every request ends with exactly the tokens it would get alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from replica.config import EngineConfig
from replica.request import Request, RequestStatus, SamplingParams
from replica.scheduler import RequestRejected, Scheduler
from tests.fake_runner import FakeRunner
from tests.helpers import scheduler_request

VOCAB_SIZE = 48  # small, so EOS (token 0) and identical blocks across requests both happen
EOS = frozenset({0})


@dataclass
class Arrival:
    request_id: str
    step: int
    prompt: list[int]
    params: SamplingParams
    abort_step: int | None
    priority: int = 0


@dataclass
class Workload:
    config: EngineConfig
    num_blocks: int
    max_model_len: int
    arrivals: list[Arrival]
    # per request id: a repeating pattern the fake model outputs (prompt-lookup drafts of it
    # get accepted, also across stop tokens and max_tokens)
    forced: dict[str, list[int]] = field(default_factory=dict)
    # a hybrid model's KV groups' windows (replica/kv_hybrid.py); empty: one table
    group_windows: tuple[int | None, ...] = ()


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 96))
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(1, 128))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 64))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    config = EngineConfig(
        scheduling_policy=policy,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.one_of(st.just(0), st.integers(1, 32))),
        num_speculative_tokens=draw(st.sampled_from([0, 0, 1, 3, 5])),
        prompt_lookup_min=draw(st.integers(1, 2)),
        prompt_lookup_max=draw(st.integers(2, 4)),
    )
    # around what one longest request needs: several requests then compete for blocks
    num_blocks = max(1, -(-max_model_len // block_size) + draw(st.integers(-2, 12)))
    token = st.integers(0, VOCAB_SIZE - 1)
    prefixes = draw(st.lists(st.lists(token, max_size=40), min_size=1, max_size=3))
    arrivals = []
    forced = {}
    for i in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(token, min_size=1 if not prefix else 0, max_size=24))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 48)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(token, max_size=1)),
            # greedy (the fake model ignores it): drafts are proposed for greedy requests only
            temperature=draw(st.sampled_from([0.0, 0.0, 1.0])),
        )
        if draw(st.booleans()):
            forced[f"r{i}"] = draw(st.lists(token, min_size=1, max_size=4)) * 48
        abort_step = draw(st.one_of(st.none(), st.none(), st.integers(0, 40)))
        arrivals.append(
            Arrival(
                f"r{i}",
                draw(st.sampled_from([0, 0, 1, 2, 4, 8, 12])),
                prefix + suffix,
                params,
                abort_step,
                draw(st.integers(0, 2)) if policy == "priority" else 0,
            )
        )
    arrivals.sort(key=lambda a: a.step)
    # group 0 attends fully (as kv_groups.py orders them): the fake runner checks its table
    windows = draw(st.sampled_from([(), (), (None, 3), (None, 5, 5, 5), (None, 1, 9)]))
    if windows:  # room for the windowed groups' blocks too
        num_blocks += draw(st.integers(0, 3 * len(windows)))
    return Workload(config, num_blocks, max_model_len, arrivals, forced, windows)


def _same_step_workload() -> Workload:
    """A's first chunk ends inside its second block; B, admitted in the same step, shares A's
    prefix: it may hit only the block A has filled completely."""
    shared = list(range(1, 9))
    config = EngineConfig(block_size=4, max_num_batched_tokens=12, long_prefill_token_threshold=6)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    arrivals = [
        Arrival(rid, 0, [*shared, tail], params, None) for rid, tail in (("A", 9), ("B", 10))
    ]
    return Workload(config, num_blocks=16, max_model_len=64, arrivals=arrivals)


same_step_prefix_hit_on_a_chunk_in_flight = _same_step_workload()


def _victim_first_workload() -> Workload:
    """Priority policy, every block taken: the running request of lowest priority (first in
    the running list) needs a block and is itself the victim; the higher-priority request after
    it must still run in that step (found by this test: the step once ran nothing)."""
    config = EngineConfig(
        scheduling_policy="priority", block_size=1, max_num_seqs=2, max_num_batched_tokens=8,
        enable_chunked_prefill=False, enable_prefix_caching=False,
    )  # fmt: skip
    arrivals = [
        Arrival(rid, step, [0, 0], SamplingParams(max_tokens=n), None, priority)
        for rid, step, n, priority in (("r0", 0, 5, 1), ("r1", 0, 1, 0), ("r2", 0, 1, 0),
                                       ("r3", 2, 4, 0))
    ]  # fmt: skip
    return Workload(config, num_blocks=9, max_model_len=8, arrivals=arrivals)


lowest_priority_victim_before_a_higher_one = _victim_first_workload()


def _preempted_in_its_step_workload() -> Workload:
    """Priority policy, block size 1: r1 (lowest priority) is scheduled, its allocation caches
    the block of its newest token, and a request arriving in that step takes its seat, so r1
    is preempted before the step runs. The block was never computed; r1's resumption must not
    find it in the prefix cache (found by this test once its fake model repeated tokens: r1
    read a block that held nothing)."""
    config = EngineConfig(
        block_size=1, max_num_seqs=2, max_num_batched_tokens=12, enable_chunked_prefill=False,
        num_speculative_tokens=0,
    )  # fmt: skip
    greedy = dict(temperature=0.0)
    arrivals = [
        Arrival(rid, step, prompt, SamplingParams(max_tokens=n, **greedy), None, priority)
        for rid, step, prompt, n, priority in (("r1", 0, [0], 3, 1), ("r2", 0, [0], 1, 0),
                                               ("r4", 0, [0, 0], 5, 0), ("r3", 2, [0], 1, 0),
                                               ("r0", 4, [0], 1, 0))
    ]  # fmt: skip
    return Workload(config, 12, 12, arrivals, forced={"r1": [1] * 48})


preempted_in_the_step_that_cached_its_block = _preempted_in_its_step_workload()


def should_reject(w: Workload, a: Arrival) -> bool:
    if len(a.prompt) + 1 > w.max_model_len:
        return True
    max_total = min(len(a.prompt) + a.params.max_tokens, w.max_model_len)
    if w.group_windows:
        return sched_for(w).kv.max_blocks(max_total, w.config.max_num_batched_tokens) > (
            w.num_blocks
        )
    return -(-max_total // w.config.block_size) > w.num_blocks


def sched_for(w: Workload) -> Scheduler:
    return Scheduler(w.config, w.num_blocks, w.max_model_len, None, w.group_windows)


def check_step_invariants(sched: Scheduler, w: Workload) -> None:
    sched.kv.check_invariants()
    assert len(sched.running) <= w.config.max_num_seqs
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        # during a step, a draft's tokens count as computed beyond the known tokens
        assert r.num_computed_tokens <= r.num_tokens + w.config.num_speculative_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
        assert sched.kv.block_ids(r.request_id) == []
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)
    stats = sched.stats()
    assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
    assert 0.0 <= stats.kv_usage <= 1.0


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
@example(same_step_prefix_hit_on_a_chunk_in_flight)
@example(lowest_priority_victim_before_a_higher_one)
@example(preempted_in_the_step_that_cached_its_block)
def test_random_workloads_keep_invariants_and_match_solo_outputs(w: Workload):
    sched = sched_for(w)
    runner = FakeRunner(w.config.block_size, vocab_size=VOCAB_SIZE, forced_tokens=w.forced)
    budget, seats = w.config.max_num_batched_tokens, w.config.max_num_seqs
    accepted: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    pending = list(w.arrivals)
    # Progress argument: the first request in (priority, arrival) order among those present is
    # never preempted and runs >= 1 token a step, so each request is the head for at most
    # max_total steps.
    bound = pending[-1].step + 1
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            request = scheduler_request(a.request_id, a.prompt, a.params, EOS, priority=a.priority)
            if should_reject(w, a):
                try:
                    sched.add_request(request)
                except RequestRejected:
                    continue
                raise AssertionError(f"{a.request_id} should have been rejected")
            sched.add_request(request)
            accepted[a.request_id] = request
            outputs[a.request_id] = []
            bound += request.max_total_tokens
        for a in w.arrivals:
            if a.abort_step == step and a.request_id in accepted:
                if sched.abort_requests([a.request_id]):
                    aborted.add(a.request_id)
        assert step <= bound, f"no end after {step} steps (livelock)"
        had_work = bool(sched.running or sched.waiting)
        out = sched.schedule()
        check_step_invariants(sched, w)
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.scheduled) <= seats
        assert not had_work or out.scheduled, "requests wait but nothing was scheduled"
        result = runner.execute(out)
        step_outputs = sched.update_from_output(out, result.sampled, spec_tokens=result.spec_tokens)
        check_step_invariants(sched, w)
        for r in sched.running:
            assert r.num_computed_tokens <= r.num_tokens
        drafts = {s.request_id: len(s.draft) for s in out.scheduled}
        for o in step_outputs:
            assert 1 <= len(o.new_token_ids) <= 1 + drafts[o.request_id]
            assert o.request_id not in aborted
            outputs[o.request_id].extend(o.new_token_ids)
        step += 1

    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    for kv in getattr(sched.kv, "groups", [sched.kv]):
        assert kv.req_to_blocks == {}
    assert not sched.running and not sched.waiting
    for rid, request in accepted.items():
        assert request.is_finished
        assert outputs[rid] == request.output_token_ids
        solo_tokens, solo_reason = runner.generate_alone(
            rid, request.prompt_token_ids, request.sampling_params, EOS, w.max_model_len
        )
        if rid in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert solo_tokens[: len(outputs[rid])] == outputs[rid]
        else:
            assert (outputs[rid], request.status.finish_reason) == (solo_tokens, solo_reason)
