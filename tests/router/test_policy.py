"""Replica ranking: load-aware scoring, stale stats, in-flight token tallies, prefix affinity by
rendezvous hashing, power-of-two choices and round robin."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.contracts import GenerateRequest
from replica.request import SamplingParams
from router.inflight import InflightLoad
from router.policy import (
    Policy,
    ReplicaStats,
    RequestSize,
    RoundRobin,
    RoutingConfig,
    effective_queue,
    kv_pressure,
    mean_request_tokens,
    preferred_replica,
    prefix_key,
    rank_replicas,
    score,
    sized_queue,
)

LOAD_AWARE = RoutingConfig()
AFFINITY = RoutingConfig(prefix_affinity=True)


def fresh(replica_id: str, ongoing: int = 0, **stats: float) -> ReplicaStats:
    return ReplicaStats(replica_id, ongoing, stats_age_s=0.5, **stats)  # type: ignore[arg-type]


def first_choice(tiers: list[list[str]]) -> str:
    assert len(tiers[0]) == 1, tiers
    return tiers[0][0]


# --- load-aware scoring ----------------------------------------------------------------------


def test_busy_replica_ranked_last() -> None:
    replicas = [fresh("a", 1), fresh("busy", 12), fresh("b", 1)]
    assert rank_replicas(replicas, LOAD_AWARE) == [["a", "b"], ["busy"]]


def test_engine_queue_counts_when_larger_than_rays_count() -> None:
    # another ingress sent requests to "b": Ray's count here misses them, the engine's does not
    replicas = [fresh("a", 2), fresh("b", 1, waiting=5, running=3)]
    assert effective_queue(replicas[1], LOAD_AWARE) == 8
    assert rank_replicas(replicas, LOAD_AWARE) == [["a"], ["b"]]


def test_requests_beyond_batch_seats_count_twice() -> None:
    stats = fresh("a", 0, waiting=4, running=8, max_num_seqs=8)
    assert score(stats, RoutingConfig(weight_kv_usage=0, weight_preemptions=0)) == 12 + 4


def test_kv_pressure_is_superlinear_near_full() -> None:
    assert kv_pressure(0.5) == pytest.approx(1.0)
    assert kv_pressure(0.9) == pytest.approx(9.0)
    assert kv_pressure(1.0) == pytest.approx(99.0)  # capped, finite
    assert kv_pressure(0.95) - kv_pressure(0.9) > 10 * (kv_pressure(0.2) - kv_pressure(0.15))


def test_kv_near_full_replica_avoided_despite_shorter_queue() -> None:
    replicas = [fresh("full", 1, kv_usage=0.97), fresh("roomy", 4, kv_usage=0.3)]
    assert rank_replicas(replicas, LOAD_AWARE) == [["roomy"], ["full"]]


def test_preempting_replica_avoided() -> None:
    replicas = [fresh("thrashing", 2, preemptions_per_s=3.0), fresh("calm", 3)]
    assert rank_replicas(replicas, LOAD_AWARE) == [["calm"], ["thrashing"]]


def test_stale_stats_fall_back_to_ongoing() -> None:
    # the last report says "b" is swamped, but it is 10 periods old; Ray's fresh count says idle
    stale = ReplicaStats("b", 0, waiting=50, running=8, kv_usage=0.99, stats_age_s=10.0)
    replicas = [fresh("a", 2), stale]
    assert score(stale, LOAD_AWARE) == 0.0
    assert rank_replicas(replicas, LOAD_AWARE) == [["b"], ["a"]]
    stale.stats_age_s = 0.5  # the same numbers, fresh: "b" is avoided
    assert rank_replicas(replicas, LOAD_AWARE) == [["a"], ["b"]]


def test_never_reported_stats_count_as_stale() -> None:
    assert ReplicaStats("a", 3, waiting=9, kv_usage=0.9).stats_age_s == float("inf")
    assert score(ReplicaStats("a", 3, waiting=9, kv_usage=0.9), LOAD_AWARE) == 3.0


def test_scores_within_tolerance_share_a_tier() -> None:
    replicas = [fresh("a", 2), fresh("b", 2, kv_usage=0.05), fresh("c", 3)]
    assert rank_replicas(replicas, RoutingConfig(score_tolerance=0.5)) == [["a", "b"], ["c"]]
    assert rank_replicas(replicas, RoutingConfig(score_tolerance=0.0)) == [["a"], ["b"], ["c"]]


def test_weights_change_the_order() -> None:
    replicas = [fresh("kv_heavy", 1, kv_usage=0.8), fresh("queued", 5)]
    assert rank_replicas(replicas, LOAD_AWARE) == [["queued"], ["kv_heavy"]]
    no_kv = RoutingConfig(weight_kv_usage=0.0)
    assert rank_replicas(replicas, no_kv) == [["kv_heavy"], ["queued"]]

    replicas = [fresh("preempting", 1, preemptions_per_s=1.0), fresh("queued", 2)]
    heavy = RoutingConfig(weight_preemptions=5.0)
    assert rank_replicas(replicas, heavy) == [["queued"], ["preempting"]]
    assert rank_replicas(replicas, RoutingConfig(weight_preemptions=0.0)) == [
        ["preempting"],
        ["queued"],
    ]


replica_stats = st.builds(
    ReplicaStats,
    replica_id=st.text("abcdef", min_size=1, max_size=4),
    ongoing=st.integers(0, 50),
    waiting=st.integers(0, 50),
    running=st.integers(0, 50),
    kv_usage=st.floats(0, 1),
    preemptions_per_s=st.floats(0, 10),
    max_num_seqs=st.integers(0, 64),
    stats_age_s=st.floats(0, 10),
    inflight_requests=st.integers(0, 20),
    inflight_tokens=st.integers(0, 40_000),
    completed_since_stats=st.integers(0, 10),
)


@given(
    st.lists(replica_stats, max_size=12, unique_by=lambda r: r.replica_id),
    st.integers(0, 5000),
)
def test_load_tiers_partition_replicas_in_score_order(
    replicas: list[ReplicaStats], request_tokens: int
) -> None:
    tiers = rank_replicas(replicas, LOAD_AWARE, request_tokens=request_tokens)
    flat = [rid for tier in tiers for rid in tier]
    assert sorted(flat) == sorted(r.replica_id for r in replicas)
    size = RequestSize.of(replicas, request_tokens)
    by_id = {r.replica_id: score(r, LOAD_AWARE, size) for r in replicas}
    scores = [by_id[rid] for rid in flat]
    assert scores == sorted(scores)
    for tier in tiers:
        assert max(by_id[r] for r in tier) - min(by_id[r] for r in tier) <= 0.5


def test_no_replicas_no_tiers() -> None:
    assert rank_replicas([], LOAD_AWARE) == []
    assert Policy(RoutingConfig(policy="pow2")).rank([]) == []


# --- prefix keys and affinity ----------------------------------------------------------------


def test_prefix_key_is_a_stable_hash_of_full_blocks_only() -> None:
    tokens = list(range(40))
    key = prefix_key(tokens, block_size=16, num_blocks=4)
    assert key == 0xF20238EDC25CBDAB  # fixed across processes and Python's hash seed
    assert prefix_key(tokens[:32] + [999] * 7, block_size=16, num_blocks=4) == key
    assert prefix_key(tokens, block_size=16, num_blocks=1) == prefix_key(
        tokens[:16], block_size=16, num_blocks=1
    )
    assert prefix_key([7] + tokens[1:], block_size=16, num_blocks=4) != key
    assert prefix_key(tokens[:15], block_size=16, num_blocks=4) is None


def test_prefix_affinity_is_stable_across_calls_and_policies() -> None:
    replicas = [fresh(f"r{i}", 1) for i in range(5)]
    key = prefix_key(list(range(64)), 16, 4)
    expected = preferred_replica(key, [r.replica_id for r in replicas])
    policy = Policy(AFFINITY, rng=random.Random(0))
    for _ in range(20):
        assert first_choice(policy.rank(replicas, prefix=key)) == expected
    # the order the router lists replicas in does not matter
    assert first_choice(policy.rank(replicas[::-1], prefix=key)) == expected
    pow2 = Policy(RoutingConfig(policy="pow2", prefix_affinity=True), rng=random.Random(1))
    assert first_choice(pow2.rank(replicas, prefix=key)) == expected


def test_prefix_affinity_keeps_the_rest_in_load_order() -> None:
    replicas = [fresh("a", 0), fresh("b", 1), fresh("c", 3)]
    key = next(k for k in range(1000) if preferred_replica(k, ["a", "b", "c"]) == "c")
    assert rank_replicas(replicas, AFFINITY, prefix=key) == [["c"], ["a"], ["b"]]
    assert rank_replicas(replicas, LOAD_AWARE, prefix=key) == [["a"], ["b"], ["c"]]


def test_rendezvous_spreads_prefixes_evenly() -> None:
    ids = [f"replica-{i}" for i in range(4)]
    counts = Counter(preferred_replica(prefix_key([k] * 16, 16, 1), ids) for k in range(1000))
    assert set(counts) == set(ids)
    assert all(180 <= count <= 320 for count in counts.values()), counts


def test_removing_a_replica_only_remaps_its_prefixes() -> None:
    ids = [f"replica-{i}" for i in range(5)]
    keys = [prefix_key([k, k + 1] * 8, 16, 1) for k in range(1000)]
    before = {k: preferred_replica(k, ids) for k in keys}
    after = {k: preferred_replica(k, ids[:2] + ids[3:]) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "replica-2"}
    assert 100 < len(moved) < 300


def test_prefix_affinity_yields_to_load_when_imbalanced() -> None:
    cfg = RoutingConfig(prefix_affinity=True, imbalance_threshold=4)
    key = next(k for k in range(1000) if preferred_replica(k, ["a", "b"]) == "a")
    at_threshold = [fresh("a", 6), fresh("b", 2)]
    assert first_choice(rank_replicas(at_threshold, cfg, prefix=key)) == "a"
    beyond = [fresh("a", 7), fresh("b", 2)]
    assert rank_replicas(beyond, cfg, prefix=key) == [["b"], ["a"]]
    # the gap uses the engine's queue when its stats are fresh
    hidden = [fresh("a", 1, waiting=10), fresh("b", 2)]
    assert rank_replicas(hidden, cfg, prefix=key) == [["b"], ["a"]]


def test_prefix_affinity_yields_to_a_replica_busy_with_huge_requests() -> None:
    cfg = RoutingConfig(prefix_affinity=True, imbalance_threshold=4)
    key = next(k for k in range(1000) if preferred_replica(k, ["a", "b"]) == "a")
    # equal counts: "a" holds two long requests and a filling cache, "b" two chat turns
    busy = [
        fresh("a", 2, inflight_requests=2, inflight_tokens=2560, kv_usage=0.5),
        fresh("b", 2, inflight_requests=2, inflight_tokens=96, kv_usage=0.02),
    ]
    assert max(effective_queue(r, cfg) for r in busy) == 2  # counts alone would keep affinity
    assert rank_replicas(busy, cfg, prefix=key) == [["b"], ["a"]]
    light = [
        fresh("a", 2, inflight_requests=2, inflight_tokens=128, kv_usage=0.05),
        fresh("b", 2, inflight_requests=2, inflight_tokens=96, kv_usage=0.02),
    ]
    assert first_choice(rank_replicas(light, cfg, prefix=key)) == "a"


def test_policy_prefix_key_only_with_affinity() -> None:
    tokens = list(range(64))
    assert Policy(LOAD_AWARE).prefix_key(tokens, 16) is None
    assert Policy(AFFINITY).prefix_key(tokens, 16) == prefix_key(tokens, 16, 4)


# --- pow2 and round robin --------------------------------------------------------------------


def test_pow2_never_picks_the_worse_of_its_two_samples() -> None:
    replicas = [fresh(f"r{i}", ongoing=i) for i in range(6)]
    ongoing = {r.replica_id: r.ongoing for r in replicas}
    policy = Policy(RoutingConfig(policy="pow2"), rng=random.Random(7))
    firsts = Counter()
    for _ in range(300):
        tiers = policy.rank(replicas)
        assert len(tiers) == 2 and all(len(t) == 1 for t in tiers)
        (best,), (other,) = tiers
        assert best != other and ongoing[best] < ongoing[other]
        firsts[best] += 1
    assert "r5" not in firsts  # the busiest replica can only ever be the worse sample
    assert set(firsts) == {"r0", "r1", "r2", "r3", "r4"}  # but it is random, not argmin


def test_pow2_is_reproducible_with_a_seeded_rng() -> None:
    replicas = [fresh(f"r{i}", ongoing=i % 3) for i in range(8)]
    cfg = RoutingConfig(policy="pow2")
    policy1, policy2 = Policy(cfg, random.Random(3)), Policy(cfg, random.Random(3))
    run1 = [policy1.rank(replicas) for _ in range(10)]
    run2 = [policy2.rank(replicas) for _ in range(10)]
    assert run1 == run2
    assert len({tuple(map(tuple, tiers)) for tiers in run1}) > 1


def test_round_robin_cycles_and_survives_membership_changes() -> None:
    policy = Policy(RoutingConfig(policy="round_robin"))
    replicas = [fresh("c", 9), fresh("a", 0), fresh("b", 0)]
    picks = [first_choice(policy.rank(replicas)) for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert policy.rank(replicas) == [["a"], ["b"], ["c"]]  # the rest follow as fallbacks
    survivors = [r for r in replicas if r.replica_id != "b"]
    assert sorted(first_choice(policy.rank(survivors)) for _ in range(4)) == ["a", "a", "c", "c"]


def test_round_robin_state_is_required() -> None:
    with pytest.raises(ValueError, match="stateful"):
        rank_replicas([fresh("a")], RoutingConfig(policy="round_robin"))
    rr = RoundRobin()
    assert [rr.next(["x", "y"])[0] for _ in range(3)] == ["x", "y", "x"]


# --- in-flight tokens (this router's own tally) ----------------------------------------------


def test_a_long_request_avoids_long_ones_a_short_one_only_needs_a_seat() -> None:
    # Ray counts 1 on "long" (a 1k-token prompt with a 256-token answer, cache half full) and 3
    # on "shorts" (chat turns); only this router's token tally tells them apart
    replicas = [
        fresh("long", 1, inflight_requests=1, inflight_tokens=1280, kv_usage=0.5),
        fresh("shorts", 3, inflight_requests=3, inflight_tokens=144, kv_usage=0.05),
    ]
    assert first_choice(rank_replicas(replicas, LOAD_AWARE, request_tokens=1280)) == "shorts"
    assert first_choice(rank_replicas(replicas, LOAD_AWARE, request_tokens=48)) == "long"
    # size unknown: counted as an average request, which the long one dwarfs
    assert first_choice(rank_replicas(replicas, LOAD_AWARE)) == "shorts"


def test_sized_queue_adds_kv_contention_beyond_one_unit_per_request() -> None:
    cfg = RoutingConfig(weight_kv_usage=0, weight_preemptions=0)
    replicas = [
        fresh("a", 1, inflight_requests=1, inflight_tokens=500),
        fresh("b", 1, inflight_requests=1, inflight_tokens=100),
        fresh("c", 2, inflight_requests=2, inflight_tokens=480),
        fresh("d", 3, waiting=1, running=4, inflight_requests=1, inflight_tokens=120),
    ]
    assert mean_request_tokens(replicas) == 240
    double = RequestSize.of(replicas, request_tokens=480)
    assert double == RequestSize(240.0, 2.0)
    # a: 1 + (2 * 500/240 - 1)/2; b and d: smaller than one unit each, no contention;
    # c: 2 + (2 * 480/240 - 2)/2; d: the engine reports 5
    expected = [1 + (2 * 500 / 240 - 1) / 2, 1.0, 3.0, 5.0]
    assert [sized_queue(r, cfg, double) for r in replicas] == pytest.approx(expected)
    assert [score(r, cfg, double) for r in replicas] == pytest.approx(expected)
    average = RequestSize.of(replicas)  # size unknown: an average request
    assert average.relative == 1.0
    assert [sized_queue(r, cfg, average) for r in replicas] == pytest.approx(
        [1 + (500 / 240 - 1) / 2, 1.0, 2.0, 5.0]
    )
    # scaling every size changes nothing: sizes are relative to the average
    scaled = [
        fresh(
            r.replica_id,
            r.ongoing,
            waiting=r.waiting,
            running=r.running,
            inflight_requests=r.inflight_requests,
            inflight_tokens=10 * r.inflight_tokens,
        )
        for r in replicas
    ]
    assert rank_replicas(scaled, cfg, request_tokens=4800) == rank_replicas(
        replicas, cfg, request_tokens=480
    )
    assert RequestSize.of([fresh("idle")], request_tokens=100) == RequestSize(0.0, 1.0)
    assert sized_queue(replicas[0], cfg, RequestSize()) == 1.0


def test_equal_sizes_leave_the_counts_alone() -> None:
    replicas = [fresh(f"r{i}", i, inflight_requests=i, inflight_tokens=64 * i) for i in range(4)]
    size = RequestSize.of(replicas, request_tokens=64)
    assert [sized_queue(r, LOAD_AWARE, size) for r in replicas] == [0, 1, 2, 3]


def test_kv_term_is_weighted_by_the_request_size() -> None:
    cfg = RoutingConfig(weight_preemptions=0)
    stats = fresh("a", 0, kv_usage=0.5)
    assert score(stats, cfg, RequestSize(100.0, 0.25)) == pytest.approx(4 * 0.25 * 1.0)
    assert score(stats, cfg, RequestSize(100.0, 3.0)) == pytest.approx(4 * 1.0)  # capped at 1
    assert score(stats, cfg) == pytest.approx(4 * 1.0)


def test_own_tally_counts_when_rays_count_is_missing() -> None:
    # Ray's cache entry expired (None -> 0) and the stats are stale: our tally still knows
    stats = ReplicaStats("a", 0, inflight_requests=3, inflight_tokens=300, stats_age_s=99.0)
    assert effective_queue(stats, LOAD_AWARE) == 3


def test_requests_finished_since_the_report_no_longer_count() -> None:
    # the report (0.5 s old) says 8 on the engine; 6 of ours finished since; Ray counts 2
    stats = fresh("a", 2, waiting=4, running=4, completed_since_stats=6)
    assert effective_queue(stats, LOAD_AWARE) == 2
    stats.completed_since_stats = 2  # others' requests still count
    assert effective_queue(stats, LOAD_AWARE) == 6
    stats.completed_since_stats = 50
    assert effective_queue(stats, LOAD_AWARE) == 2  # never below Ray's own count


def test_inflight_load_tallies_routed_and_completed_requests() -> None:
    load = InflightLoad()
    load.routed("r1", "a", 1280)
    load.routed("r2", "a", 48)
    load.routed("r3", "b", 48)
    load.routed("r3", "b", 48)  # a repeated hook call counts once
    assert (load.requests("a"), load.tokens("a")) == (2, 1328)
    assert (load.requests("b"), load.tokens("b")) == (1, 48)
    load.completed("r1", "a", now=10.0)
    load.completed("r3", "b", now=11.0)
    assert (load.requests("a"), load.tokens("a")) == (1, 48)
    assert (load.requests("b"), load.tokens("b")) == (0, 0)
    assert load.completed_since("a", 9.5) == 1
    assert load.completed_since("a", 10.0) == 0
    assert load.completed_since("b", 0.0) == 1
    assert load.completed_since("unknown", 0.0) == 0


def test_inflight_load_early_completion_leaves_no_phantom() -> None:
    load = InflightLoad()
    load.completed("fast", "a", now=1.0)  # the done-callback ran before the routed hook
    load.routed("fast", "a", 100)
    assert (load.requests("a"), load.tokens("a")) == (0, 0)
    # a request rejected by "a" (its completion fires there) and then accepted by "b" counts
    load.completed("bounced", "a", now=2.0)
    load.routed("bounced", "b", 64)
    assert (load.requests("b"), load.tokens("b")) == (1, 64)
    bounded = InflightLoad(max_early=2)
    for i in range(5):
        bounded.completed(f"x{i}", "a", now=float(i))
    assert len(bounded._finished_early) == 2


def test_inflight_load_prunes_old_completions_and_gone_replicas() -> None:
    load = InflightLoad(completion_window_s=5.0)
    for i in range(3):
        load.routed(f"r{i}", "a", 10)
        load.completed(f"r{i}", "a", now=float(i))
    load.routed("late", "a", 10)
    load.completed("late", "a", now=100.0)
    assert load.completed_since("a", -1.0) == 1  # the three old ones were pruned
    load.routed("stuck", "gone", 500)
    load.forget_missing(["a"])
    assert (load.requests("gone"), load.tokens("gone")) == (0, 0)
    load.completed("stuck", "gone", now=101.0)  # its late completion changes nothing
    assert load.tokens("gone") == 0


# --- prefill still ahead (phase) -------------------------------------------------------------


def test_a_new_request_avoids_a_replica_still_prefilling_a_long_prompt() -> None:
    # both replicas hold one long request of ours (same footprint, same count); on "prefilling"
    # 1024 prompt tokens are still to be prefilled in 256-token steps, "decoding" is past it
    replicas = [
        fresh(
            "prefilling",
            1,
            inflight_requests=1,
            inflight_tokens=1280,
            max_num_batched_tokens=256,
            prefill_tokens=1024,
        ),
        fresh("decoding", 1, inflight_requests=1, inflight_tokens=1280, max_num_batched_tokens=256),
    ]
    for tokens in (48, 1280):
        assert (
            first_choice(rank_replicas(replicas, LOAD_AWARE, request_tokens=tokens)) == "decoding"
        )
    assert score(replicas[0], LOAD_AWARE) - score(replicas[1], LOAD_AWARE) == pytest.approx(4.0)
    # a short request still prefers a long prompt's last chunk to three more requests ahead
    nearly = fresh(
        "nearly",
        1,
        inflight_requests=1,
        inflight_tokens=1280,
        max_num_batched_tokens=256,
        prefill_tokens=200,
    )
    busy = fresh("busy", 4, inflight_requests=4, inflight_tokens=192, max_num_batched_tokens=256)
    assert first_choice(rank_replicas([nearly, busy], LOAD_AWARE, request_tokens=48)) == "nearly"
    # the term is off with weight 0 and when the replica's budget is unknown
    no_phase = RoutingConfig(weight_prefill=0.0)
    assert score(replicas[0], no_phase) == score(replicas[1], no_phase)
    unknown = fresh("u", 1, inflight_requests=1, inflight_tokens=1280, prefill_tokens=1024)
    assert score(unknown, LOAD_AWARE) == score(replicas[1], LOAD_AWARE)


def test_inflight_load_counts_prefill_until_the_first_token() -> None:
    load = InflightLoad(rate_alpha=0.5)
    load.routed("r1", "a", 1280, prompt_tokens=1024, key="k1", now=0.0)
    load.routed("r2", "a", 48, prompt_tokens=32, key="k2", now=0.0)
    load.routed("r3", "b", 48)  # no key (a call without our payload): never counted as prefill
    assert (
        load.prefill_by_replica(now=5.0).get("a", 0) == 1056
    )  # no rate learned yet: whole prompts
    assert load.prefill_by_replica(now=5.0).get("b", 0) == 0
    load.first_token("k2", now=0.1)  # 32 tokens in 0.1 s: 320 tokens/s
    assert load.prefill_rate == pytest.approx(320.0)
    assert load.prefill_by_replica(now=1.0).get("a", 0) == pytest.approx(1024 - 320)  # discounted
    assert load.prefill_by_replica(now=4.0).get("a", 0) == 0  # the estimate says it must be done
    load.first_token("k2", now=9.0)  # a repeated or unknown key changes nothing
    load.first_token("nope", now=9.0)
    assert load.prefill_rate == pytest.approx(320.0)
    load.first_token("k1", now=1.024)  # tokens and seconds averaged apart, alpha 0.5
    assert load.prefill_rate == pytest.approx((1024 + 32) / (1.024 + 0.1))
    assert load.prefill_by_replica(now=1.1).get("a", 0) == 0
    # a request that ends before its first token (aborted, failed) leaves no prefill behind
    load.routed("r4", "b", 600, prompt_tokens=512, key="k4", now=2.0)
    assert load.prefill_by_replica(now=2.0).get("b", 0) == 512
    load.finished("k4", now=2.1)
    assert load.prefill_by_replica(now=2.1).get("b", 0) == 0
    load.routed("r5", "gone", 600, prompt_tokens=512, key="k5", now=3.0)
    load.forget_missing(["a", "b"])
    assert load.prefill_by_replica(now=3.0).get("gone", 0) == 0 and not load._prefilling


def test_inflight_load_keyed_requests_end_when_their_sender_says() -> None:
    load = InflightLoad()
    # Ray 2.60 completes a stream as the replica accepts it, before on_request_routed: for a
    # request whose sender reports its end, neither that nor a later Ray completion counts
    load.completed("ray-1", "a", now=1.0)
    load.routed("ray-1", "a", 300, prompt_tokens=256, key="k1", now=1.0)
    load.completed("ray-1", "a", now=1.5)
    assert (load.requests("a"), load.tokens("a")) == (1, 300)
    assert load.completed_since("a", 0.0) == 0
    load.finished("k1", now=2.0)
    assert (load.requests("a"), load.tokens("a")) == (0, 0)
    assert load.completed_since("a", 1.9) == 1
    load.finished("k1", now=3.0)  # repeated, or another router's key: nothing happens
    load.finished("unknown", now=3.0)
    assert (load.requests("a"), load.completed_since("a", 1.9)) == (0, 1)
    # unkeyed requests (senders that report nothing) still end at Ray's completion
    load.routed("ray-2", "a", 40)
    load.completed("ray-2", "a", now=4.0)
    assert (load.requests("a"), load.tokens("a")) == (0, 0)
    # a replica that goes away takes its keyed requests with it
    load.routed("ray-3", "gone", 300, prompt_tokens=256, key="k3", now=5.0)
    load.forget_missing(["a"])
    assert (load.requests("gone"), load.prefill_by_replica(5.0).get("gone", 0)) == (0, 0)
    load.finished("k3", now=6.0)
    assert load.tokens("gone") == 0


def test_request_tokens_reads_the_ingress_request() -> None:
    """The KV footprint the router weighs a request by: prompt + max_tokens."""
    request = GenerateRequest([1] * 30, SamplingParams(max_tokens=16), "r1", prefix_key=None)
    assert (request.footprint_tokens, request.num_prompt_tokens) == (46, 30)
    assert GenerateRequest([1, 2], SamplingParams(max_tokens=1), "r2").footprint_tokens == 3


def test_candidates_sample_for_pow2_and_max_candidates_keeping_the_prefix_replica():
    import random as _random

    from router.policy import Policy, RoutingConfig, preferred_replica

    ids = [f"r{i}" for i in range(100)]
    assert len(Policy(RoutingConfig(policy="pow2"), _random.Random(0)).candidates(ids)) == 2
    assert Policy(RoutingConfig(), _random.Random(0)).candidates(ids) == ids  # 0: every replica
    cfg = RoutingConfig(max_candidates=8, prefix_affinity=True)
    policy = Policy(cfg, _random.Random(0))
    for prefix in range(50):
        picked = policy.candidates(ids, prefix)
        assert len(picked) == 8 and len(set(picked)) == 8
        assert preferred_replica(prefix, ids) in picked
    spread = {rid for _ in range(200) for rid in policy.candidates(ids)}
    assert len(spread) > 90  # a random sample each time, not a fixed subset


def test_sampled_candidates_always_hold_the_replicas_with_the_prompt_cached():
    import random as _random

    from router.policy import Policy, RoutingConfig

    ids = [f"r{i}" for i in range(1000)]
    policy = Policy(RoutingConfig(max_candidates=16, kv_events=True), _random.Random(1))
    cached = {"r7": 512, "r900": 256, "r3": 16, "r4": 16, "r5": 16}
    for _ in range(20):
        picked = policy.candidates(ids, None, cached)
        assert len(picked) == 16 and len(set(picked)) == 16
        assert {"r7", "r900", "r3", "r4"} <= set(picked)  # the top k // 4 holders


def test_inflight_load_counts_a_choice_until_it_is_routed() -> None:
    load = InflightLoad(choice_ttl_s=5.0)
    load.chosen("r1", "a", 100, now=0.0)
    load.chosen("r2", "a", 50, now=0.0)
    assert (load.requests("a"), load.tokens("a"), load.choices()) == (2, 150, 2)
    load.chosen("r2", "b", 50, now=0.1)  # chosen again (its first replica refused it)
    assert (load.requests("a"), load.requests("b")) == (1, 1)
    load.routed("r1", "a", 100)  # routed where it was chosen: counted once
    assert (load.requests("a"), load.tokens("a"), load.choices()) == (1, 100, 1)
    load.routed("r2", "a", 50, key="k2")  # routed elsewhere than last chosen: counted there
    assert (load.requests("a"), load.requests("b"), load.choices()) == (2, 0, 0)
    load.chosen("r3", "b", 10, now=1.0)
    load.completed("r3", "b", now=1.2)  # a rejection's completion ends the choice too
    assert (load.requests("b"), load.choices()) == (0, 0)
    load.chosen("lost", "b", 10, now=2.0)  # cancelled while waiting: never routed
    assert load.requests("b") == 1
    load.chosen("r4", "a", 10, now=7.5)  # past the choice's time to live: it expires
    assert (load.requests("b"), load.choices()) == (0, 1)
    load.chosen("r5", "gone", 10, now=8.0)
    load.forget_missing(["a", "b"])
    assert (load.requests("gone"), load.choices()) == (0, 1)
    assert load.snapshot(8.0)["replicas"]["a"]["requests"] == 3  # 2 routed, 1 chosen


def _burst(noted: bool, n: int = 8) -> Counter:
    """`n` requests routed as Ray routes a burst: every decision before the first of them is
    reported routed, Ray's in-flight count still 0 everywhere; replica b's fresh report shows
    one request running, so a scores lower at first."""
    from replica.contracts import RoutingStats
    from router.inflight import replica_stats
    from router.policy import lead_replica

    load, policy, rng = InflightLoad(), Policy(LOAD_AWARE), random.Random(0)
    reports = {"a": RoutingStats("a", ts=99.5), "b": RoutingStats("b", ts=99.5, running=1)}
    placed: Counter = Counter()
    for i in range(n):
        stats = [replica_stats(rid, 0, reports[rid], load, 0.0, 100.0) for rid in ("a", "b")]
        tiers = policy.rank(stats, request_tokens=200)
        lead = lead_replica(tiers[0], stats, LOAD_AWARE, rng)[0]
        if noted:
            load.chosen(f"r{i}", lead, 200, now=100.0)
        placed[lead] += 1
    return placed


def test_a_burst_spreads_when_each_choice_is_counted_before_it_is_routed() -> None:
    assert _burst(noted=False) == Counter({"a": 8})  # the herd: every decision saw the same
    placed = _burst(noted=True)
    assert sorted(placed.values()) == [4, 4] or sorted(placed.values()) == [3, 5], placed


@pytest.mark.parametrize(
    "cfg",
    [
        LOAD_AWARE,
        RoutingConfig(max_candidates=3, prefix_affinity=True),
        RoutingConfig(policy="pow2"),
        RoutingConfig(policy="round_robin"),
    ],
    ids=["load_aware", "sampled-affinity", "pow2", "round_robin"],
)
def test_decide_is_the_candidates_stats_ranking_and_lead_the_router_and_simulator_share(cfg):
    """router.decision.decide, which LoadAwareRouter and the simulator both call: the same
    candidates, stats, tiers and lead as the steps it stands for, and the lead alone first."""
    from replica.contracts import RoutingStats
    from router.decision import decide
    from router.inflight import replica_stats
    from router.policy import decision_reason, lead_replica

    ids = [f"r{i}" for i in range(6)]
    reports = {
        rid: RoutingStats(rid, ts=99.5, running=i % 3, waiting=i % 2) for i, rid in enumerate(ids)
    }
    ongoing = {rid: i % 4 for i, rid in enumerate(ids)}
    hits = {"r2": 64, "r4": 32}
    for seed in range(20):
        loads = [InflightLoad(), InflightLoad()]
        for load in loads:
            load.routed("x", "r1", 300, prompt_tokens=200, key="x", now=99.0)
        got = decide(
            Policy(cfg, random.Random(seed)), loads[0], ids,
            lambda rid: (ongoing[rid], reports[rid]), 100.0, random.Random(seed + 1),
            prefix=seed * 7919, footprint_tokens=100, hits=hits,
        )  # fmt: skip
        policy, rng = Policy(cfg, random.Random(seed)), random.Random(seed + 1)
        cands = policy.candidates(ids, seed * 7919, hits)
        prefill = loads[1].prefill_by_replica(100.0, cands)
        stats = [
            replica_stats(
                r, ongoing[r], reports[r], loads[1], prefill.get(r, 0.0), 100.0, hits.get(r, 0)
            )
            for r in cands
        ]
        tiers = policy.rank(stats, seed * 7919, 100)
        lead, *rest = lead_replica(tiers[0], stats, cfg, rng)
        assert got.stats == stats
        assert got.tiers == [t for t in [[lead], rest, *tiers[1:]] if t]
        assert got.lead == lead
        size = RequestSize.of(stats, 100)
        assert got.reason(lead, cfg) == decision_reason(stats, cfg, lead, size)
        assert got.reason("not-a-candidate", cfg) is None
    empty = decide(Policy(cfg), InflightLoad(), [], lambda rid: (0, None), 0.0, random.Random())
    assert (empty.tiers, empty.lead) == ([], None)
