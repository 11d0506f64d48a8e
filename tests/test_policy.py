"""Replica ranking: load-aware scoring, stale stats, prefix affinity by rendezvous hashing,
power-of-two choices and round robin."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.policy import (
    Policy,
    ReplicaStats,
    RoundRobin,
    RoutingConfig,
    effective_queue,
    kv_pressure,
    preferred_replica,
    prefix_key,
    rank_replicas,
    score,
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
)


@given(st.lists(replica_stats, max_size=12, unique_by=lambda r: r.replica_id))
def test_load_tiers_partition_replicas_in_score_order(replicas: list[ReplicaStats]) -> None:
    tiers = rank_replicas(replicas, LOAD_AWARE)
    flat = [rid for tier in tiers for rid in tier]
    assert sorted(flat) == sorted(r.replica_id for r in replicas)
    by_id = {r.replica_id: score(r, LOAD_AWARE) for r in replicas}
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
