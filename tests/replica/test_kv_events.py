"""KV events (replica/kv_events.py), the router's index of every replica's prefix cache
(router/kv_index.py), the hub between them, and the cache term of the routing policy."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from replica.config import EngineConfig
from replica.hub import ApplicationHub, hub_name
from replica.kv_events import (
    REMOVED,
    STORED,
    KVEventBatch,
    KVEventHub,
    KVSnapshot,
)
from replica.request import ROOT_BLOCK_HASH, SamplingParams, extend_block_hashes
from replica.scheduler import Scheduler
from router.kv_index import KVIndex
from router.kv_routing import KVRouting, exposition, note_cached, register_kv_routing
from router.policy import Policy, ReplicaStats, RequestSize, RoutingConfig, decision_reason
from tests.helpers import scheduler_request

BS = 4


def _scheduler(num_blocks: int = 24) -> Scheduler:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=BS)
    return Scheduler(cfg, num_blocks, 256)


def _run_steps(sched: Scheduler, rng: random.Random, steps: int, new_requests) -> None:
    """Step the scheduler with a fake runner (always token 7), feeding new requests."""
    for _ in range(steps):
        for req in new_requests():
            sched.add_request(req)
        so = sched.schedule()
        sampled = {s.request_id: 7 for s in so.scheduled if s.sample}
        sched.update_from_output(so, sampled)
        yield so


def _mixed_requests(
    rng: random.Random, prefixes: list[list[int]], rate: float = 0.5, long: int = 8
):
    counter = iter(range(10**6))

    def new():
        out = []
        if rng.random() < rate:
            prompt = list(rng.choice(prefixes)) + [
                rng.randrange(10, 99) for _ in range(rng.randint(1, 9))
            ]
            params = SamplingParams(max_tokens=rng.randint(1, long), ignore_eos=True)
            out.append(scheduler_request(f"r{next(counter)}", prompt, params))
        return out

    return new


def test_index_mirrors_the_pool_exactly_through_evictions_and_preemptions() -> None:
    rng = random.Random(0)
    sched = _scheduler()
    log = sched.kv.pool.enable_events(BS)
    index = KVIndex(BS)
    prefixes = [[rng.randrange(10, 99) for _ in range(12)] for _ in range(5)]
    evictions = 0
    for _ in _run_steps(sched, rng, 400, _mixed_requests(rng, prefixes, rate=0.9, long=24)):
        batch = log.seal()
        if batch is not None:
            evictions += sum(e[0] == REMOVED for e in batch.events)
            assert index.apply("r0", batch)
        assert index.blocks_of("r0") == set(sched.kv.pool.cached)  # zero drift, every step
        assert log.snapshot().blocks.keys() == sched.kv.pool.cached.keys()
    assert evictions > 20, "the workload must evict to test removals"
    assert sched.num_preemptions_total > 0, "and preempt"


def test_predicted_hits_equal_the_schedulers_hits_when_nothing_is_evicted_between() -> None:
    rng = random.Random(1)
    sched = _scheduler(num_blocks=200)
    log = sched.kv.pool.enable_events(BS)
    index = KVIndex(BS)
    prefixes = [[rng.randrange(10, 99) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    checked = 0
    for i in range(60):
        prompt = list(rng.choice(prefixes)) + [
            rng.randrange(10, 99) for _ in range(rng.randint(0, 6))
        ]
        predicted = index.hit_tokens(index.prompt_hashes(prompt), ["r0"]).get("r0", 0)
        req = scheduler_request(f"q{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        sched.add_request(req)
        while sched.has_unfinished():
            so = sched.schedule()
            sched.update_from_output(so, {s.request_id: 7 for s in so.scheduled if s.sample})
            batch = log.seal()
            if batch is not None:
                index.apply("r0", batch)
        assert req.num_cached_tokens == predicted, (i, prompt)
        checked += predicted > 0
    assert checked > 20


def test_a_gap_makes_the_view_stale_until_a_snapshot() -> None:
    index = KVIndex(BS)
    h = extend_block_hashes([], list(range(12)), BS)
    assert index.apply("a", KVEventBatch(1, tuple((STORED, x, ROOT_BLOCK_HASH, BS) for x in h)))
    assert index.hit_tokens(h, ["a"]) == {"a": 12}
    assert not index.apply("a", KVEventBatch(3, ((REMOVED, h[2]),)))  # batch 2 missed
    assert index.seq("a") is None and index.gaps == 1
    assert index.hit_tokens(h, ["a"]) == {}  # no predictions from a stale view
    assert not index.apply("a", KVEventBatch(4, ()))  # still stale
    index.load_snapshot("a", KVSnapshot(4, {h[0]: ROOT_BLOCK_HASH, h[1]: h[0]}))
    assert index.seq("a") == 4 and index.hit_tokens(h, ["a"]) == {"a": 8}
    assert index.apply("a", KVEventBatch(5, ((REMOVED, h[0]),)))
    assert index.hit_tokens(h, ["a"]) == {}  # replicas holding nothing of it are left out


def test_hits_per_replica_are_the_longest_leading_run_and_removal_forgets() -> None:
    index = KVIndex(BS)
    h = extend_block_hashes([], list(range(20)), BS)  # 5 blocks
    index.apply("a", KVEventBatch(1, tuple((STORED, x, 0, BS) for x in h[:4])))
    index.apply("b", KVEventBatch(1, tuple((STORED, x, 0, BS) for x in h[:1] + h[2:])))
    index.apply("c", KVEventBatch(1, tuple((STORED, x, 0, BS) for x in h)))
    assert index.hit_tokens(h) == {"a": 16, "b": 4, "c": 20}
    assert index.hit_tokens(h[:3], ["a", "b", "x"]) == {"a": 12, "b": 4}
    index.remove_replica("c")
    assert index.hit_tokens(h) == {"a": 16, "b": 4}
    assert index.num_entries == 5  # h[4] only b holds now
    index.remove_replica("a")
    index.remove_replica("b")
    assert index.num_entries == 0
    index.apply("d", KVEventBatch(1, ((STORED, h[0], 0, BS),)))  # a freed slot is reused
    assert index.hit_tokens(h) == {"d": 4}


def test_prompt_hashes_leave_the_last_token_to_compute() -> None:
    index = KVIndex(BS)
    assert len(index.prompt_hashes(list(range(8)))) == 1  # 8 tokens: (8 - 1) // 4 = 1 block
    assert len(index.prompt_hashes(list(range(9)))) == 2


def test_block_hashes_are_equal_in_another_process() -> None:
    tokens = list(range(100, 164))
    here = extend_block_hashes([], tokens, 16)
    code = (
        "from replica.request import extend_block_hashes;"
        f"print(extend_block_hashes([], {tokens!r}, 16))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[2]),
    )  # fmt: skip
    assert eval(there.stdout) == here


# -- the hub ----------------------------------------------------------------------------------
def _batch(seq: int, *hashes: int) -> KVEventBatch:
    return KVEventBatch(seq, tuple((STORED, h, 0, BS) for h in hashes))


def test_hub_relays_batches_then_snapshots_for_readers_too_far_behind() -> None:
    hub = KVEventHub(keep_batches=2)
    assert hub.publish("a", [_batch(2, 5)]) == {"resync": True}  # unknown replica, not from 1
    assert hub.publish("a", [_batch(1, 1), _batch(2, 2)]) == {"resync": False}
    reply = hub.poll({"a": -1})
    assert reply["a"][0] == "snapshot" and reply["a"][1].blocks.keys() == {1, 2}
    assert hub.poll({"a": 2}) == {}
    hub.publish("a", [_batch(3, 3)])
    kind, batches = hub.poll({"a": 2})["a"]
    assert kind == "batches" and [b.seq for b in batches] == [3]
    hub.publish("a", [_batch(4, 4), _batch(5, 5)])  # keeps 2: batch 3 is gone
    assert hub.poll({"a": 2})["a"][0] == "snapshot"
    assert hub.poll({"a": 3})["a"][0] == "batches"
    assert hub.publish("a", [_batch(7, 7)]) == {"resync": True}  # a gap: the hub asks
    assert hub.poll({"a": 5}) == {"a": ("gone", None)}
    assert hub.publish("a", [], KVSnapshot(7, {1: 0, 7: 1})) == {"resync": False}
    assert hub.poll({"a": -1})["a"][1].blocks.keys() == {1, 7}
    hub.publish("b", [_batch(1, 9)], now=0.0)
    hub.publish("a", [_batch(8, 8)], now=1000.0)  # b silent for longer than forget_after_s
    assert "b" not in hub.replicas()


def test_application_hub_relays_kv_events_and_keeps_fresh_expositions(monkeypatch) -> None:
    import replica.hub

    clock = [1000.0]
    monkeypatch.setattr(replica.hub.time, "time", lambda: clock[0])
    hub = ApplicationHub()
    assert hub.publish("a", [_batch(1, 3)]) == {"resync": False}  # the KV side, as above
    assert hub.poll({"a": -1})["a"][1].blocks.keys() == {3}
    hub.push("a", b"a1")
    hub.push("b", b"b1")
    hub.push("a", b"a2")  # the latest push replaces the one before
    assert sorted(hub.expositions()) == [b"a2", b"b1"]
    assert hub.expositions(replica_ids=["b", "gone"]) == [b"b1"]
    clock[0] += 20.0
    hub.push("b", b"b2")
    clock[0] += 15.0  # a's last push is 35 s old, b's 15 s
    assert hub.expositions(max_age_s=30.0) == [b"b2"]
    assert hub.expositions(max_age_s=60.0) == [b"b2"]  # aged-out entries are dropped for good
    assert hub_name("app") == "stepserve-hub-app"


def test_kv_routing_follows_the_hub_and_checks_its_predictions() -> None:
    hub = KVEventHub()
    routing = KVRouting("app", BS, start=False)
    register_kv_routing(routing)
    prompt = list(range(40, 53))  # 13 tokens: 3 usable blocks
    hashes = extend_block_hashes([], prompt, BS)
    hub.publish("a", [_batch(1, *hashes[:2])])
    hub.publish("b", [_batch(1, *hashes[:3])])
    routing.set_live(["a", "b"])
    routing.apply_poll(hub.poll(routing.cursors()))
    assert routing.hit_tokens(prompt, ["a", "b"]) == {"a": 8, "b": 12}
    routing.routed("req-1", 12, "cache")
    note_cached("req-1", 12)
    routing.routed("req-2", 8, "load")
    note_cached("req-2", 4)
    snap = routing.snapshot()
    assert (snap["compared"], snap["exact"], snap["predicted_tokens"], snap["actual_tokens"]) == (
        2,
        1,
        20,
        16,
    )
    text = exposition("ing-1").decode()
    assert 'stepserve:router_decisions_total{ingress="ing-1",reason="cache"} 1' in text
    assert 'outcome="different"} 1' in text
    routing.set_live(["a"])  # b left Serve: gone from the index at once
    assert routing.hit_tokens(prompt, ["a", "b"]) == {"a": 8}
    routing.stop()


# -- publishing only while read ---------------------------------------------------------------
def test_the_hub_tells_a_replica_whether_a_router_reads_it(monkeypatch) -> None:
    import replica.hub
    from replica.kv_events import READ_TTL_S

    hub = KVEventHub()
    assert not hub.is_read("a", now=100.0)
    hub.poll({"a": -1, "b": 3}, now=100.0)  # unknown replicas: no news, but they are read
    assert hub.is_read("a", now=100.0 + READ_TTL_S) and hub.is_read("b", now=101.0)
    assert not hub.is_read("a", now=100.1 + READ_TTL_S)
    clock = [1000.0]
    monkeypatch.setattr(replica.hub.time, "time", lambda: clock[0])
    app_hub = ApplicationHub()
    assert app_hub.push("a", b"x") is False  # the push's answer: nobody reads "a"
    app_hub.poll({"a": -1}, now=clock[0])
    assert app_hub.push("a", b"y") is True
    clock[0] += READ_TTL_S + 1
    assert app_hub.push("a", b"z") is False


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_replica_publishes_only_while_read_and_starts_from_a_snapshot() -> None:
    """A replica alone sends nothing; once read, the hub's table equals the replica's, batch
    after batch; once no longer read, the hub forgets it; read again, it resyncs."""
    from replica.kv_events import KVEventLog
    from replica.kv_publisher import KVEventPublisher

    log = KVEventLog(BS)
    hub = KVEventHub()
    changes: list[bool] = []
    pub = KVEventPublisher(
        "a", hub, snapshot=log.snapshot, log_stats=lambda: {}, interval_s=0.001,
        on_active=changes.append,
    )  # fmt: skip
    step = iter(range(1, 10**6))

    def engine_step(*hashes: int) -> None:  # what the engine's sealer does after a step
        for h in hashes:
            log.stored(h, 0)
        pub.add_batch(log.seal())

    def hub_table() -> dict:
        reply = hub.poll({"a": -1})
        return reply["a"][1].blocks if "a" in reply else {}

    try:
        engine_step(next(step), next(step))
        assert not pub.active and pub.publish_once() == 0.0 and hub.replicas() == {}
        pub.set_active(True)
        assert changes == [True]
        _wait_for(lambda: hub.replicas().get("a") == log.seq)  # the snapshot: batch 1 in it
        assert hub_table() == log.table
        engine_step(next(step))
        log.removed(1)
        engine_step()
        _wait_for(lambda: hub.replicas().get("a") == log.seq)
        kind, batches = hub.poll({"a": 1})["a"]  # batches after the snapshot, none skipped
        assert kind == "batches" and [b.seq for b in batches] == [2, 3]
        assert hub_table() == log.table and 1 not in log.table
        assert pub.stats()["publishing"] is True
        pub.set_active(False)
        assert changes == [True, False] and hub.replicas() == {}
        engine_step(next(step))  # dropped: nobody reads
        assert hub.replicas() == {}
        pub.set_active(True)
        _wait_for(lambda: hub.replicas().get("a") == log.seq)
        assert hub_table() == log.table  # resynced, the dropped batch included
    finally:
        pub.stop()


def test_a_failed_switch_of_the_engine_is_tried_again_at_the_next_answer() -> None:
    """When the engine core does not take the switch (on_active raises), the publisher stays
    in the engine's state, so the hub's next answer tries again, not a publisher that believes
    it publishes while the engine sends no batches."""
    from replica.kv_events import KVEventLog
    from replica.kv_publisher import KVEventPublisher

    log = KVEventLog(BS)
    hub = KVEventHub()
    calls: list[bool] = []

    def on_active(active: bool) -> None:
        calls.append(active)
        if len(calls) in (1, 3):  # the first switch each way times out
            raise TimeoutError("engine core did not answer")

    pub = KVEventPublisher(
        "a", hub, snapshot=log.snapshot, log_stats=lambda: {}, interval_s=0.001,
        on_active=on_active,
    )  # fmt: skip
    try:
        with pytest.raises(TimeoutError):
            pub.set_active(True)
        assert not pub.active and pub.stats()["publishing"] is False
        pub.add_batch(log.seal())  # dropped: not publishing
        assert pub.publish_once() == 0.0 and hub.replicas() == {}
        pub.set_active(True)  # the next answer: tried again, and taken
        assert calls == [True, True] and pub.active
        _wait_for(lambda: hub.replicas().get("a") == log.seq)
        with pytest.raises(TimeoutError):
            pub.set_active(False)
        assert pub.active and calls == [True, True, False]
        pub.set_active(False)
        assert not pub.active and calls == [True, True, False, False]
        _wait_for(lambda: hub.replicas() == {})
    finally:
        pub.stop()


def test_a_router_polls_only_while_it_has_two_replicas() -> None:
    hub = KVEventHub()
    hub.publish("a", [_batch(1, 5)])
    routing = KVRouting("app", BS, start=False, hub=hub)
    routing.set_live(["a"])
    assert routing.poll_once() is False and routing.polls == 0
    assert not hub.is_read("a")  # so "a" would stop publishing
    routing.set_live(["a", "b"])
    assert routing.poll_once() is True and routing.polls == 1
    assert hub.is_read("a") and hub.is_read("b")
    assert routing.index.seq("a") == 1
    routing.stop()


# -- the policy ---------------------------------------------------------------------------------
def _stats(rid: str, ongoing: int, cached: int = 0) -> ReplicaStats:
    return ReplicaStats(
        rid, ongoing=ongoing, max_num_seqs=16, max_num_batched_tokens=1024, cached_tokens=cached
    )


def test_cache_term_wins_within_the_window_and_spills_beyond_it() -> None:
    cfg = RoutingConfig(kv_events=True, weight_cache_hit=16, cache_bonus_cap=4)
    policy = Policy(cfg)
    # b holds 512 tokens of the prompt (8 queue units of bonus) and is 3 busier: it wins
    replicas = [_stats("a", 1), _stats("b", 4, cached=512), _stats("c", 2)]
    assert policy.rank(replicas)[0] == ["b"]
    size = RequestSize.of(replicas)
    assert decision_reason(replicas, cfg, "b", size) == "cache"
    # 6 busier: outside the window, the request spills to the least loaded
    replicas = [_stats("a", 1), _stats("b", 7, cached=512), _stats("c", 2)]
    assert policy.rank(replicas)[0] == ["a"]
    assert decision_reason(replicas, cfg, "a", size) == "spill"
    # the longest hit wins among replicas in the window: a whole history over a system prompt
    replicas = [_stats("a", 2, cached=128), _stats("b", 2, cached=640), _stats("c", 1)]
    assert policy.rank(replicas)[0] == ["b"]


def test_equal_scores_with_different_hits_are_different_tiers() -> None:
    cfg = RoutingConfig(kv_events=True, weight_cache_hit=0.0, score_tolerance=5.0)
    tiers = Policy(cfg).rank([_stats("a", 1), _stats("b", 1, cached=64), _stats("c", 1)])
    assert tiers[0] == ["b"]  # Ray picks the tier's least loaded: never a replica without it
    assert sorted(tiers[1]) == ["a", "c"]
