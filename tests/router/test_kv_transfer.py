"""Fetch or recompute (router/kv_transfer.py in router/decision.py): the cost model picks the
option its numbers say, the decision attaches the fetch to its lead (never from the lead
itself), nothing changes with routing.kv_transfer off, and a drained stream's continuation
names the draining replica as its fetch's source."""

from __future__ import annotations

import asyncio
import random

import pytest

from replica.api import KVFetch, ReplicaDraining, RoutingStats
from router.decision import decide
from router.inflight import InflightLoad
from router.kv_transfer import FETCH, HERE, HOLDER, best_holder, plan_fetch
from router.policy import Policy, ReplicaStats, RoutingConfig

NOW = 100.0
ON = RoutingConfig(kv_transfer=True)
OFF = RoutingConfig(kv_transfer=False)


def report(rid: str, **fields) -> RoutingStats:
    base = dict(max_num_seqs=8, max_num_batched_tokens=256, prefill_tokens_per_s=1000.0,
                kv_transfer_bytes_per_s=1e9, kv_bytes_per_block=1_000_000)  # fmt: skip
    return RoutingStats(rid, ts=NOW - 0.1, **(base | fields))


def stats(rid: str, cached: int = 0, prefill: float = 0.0, queue: int = 0) -> ReplicaStats:
    return ReplicaStats(rid, ongoing=queue, max_num_seqs=8, stats_age_s=0.1,
                        cached_tokens=cached, prefill_tokens=prefill)  # fmt: skip


def plan(lead, holder, prompt=1024, cfg=ON, reports=None, **kw):
    reports = reports or {}
    return plan_fetch(lead, holder, prompt, 16, cfg,
                      lambda rid: reports.get(rid, report(rid)), **kw)  # fmt: skip


# --- the cost model ----------------------------------------------------------------------------
def test_a_fast_link_fetches_the_holders_prefix_instead_of_recomputing_it() -> None:
    # 960 cached tokens = 60 blocks = 60 MB at 1 GB/s: 65 ms against 0.96 s of prefill
    got = plan(stats("a"), stats("h", cached=960, queue=8))  # the holder is full
    assert got.choice == FETCH and (got.source, got.target, got.num_blocks) == ("h", "a", 60)
    assert got.costs[FETCH] == pytest.approx(0.005 + 0.06 + 64 / 1000)
    assert got.costs[HERE] == pytest.approx(1.024)


def test_a_slow_link_recomputes() -> None:
    slow = {rid: report(rid, kv_transfer_bytes_per_s=2e7) for rid in ("a", "h")}  # 20 MB/s
    got = plan(stats("a"), stats("h", cached=960, queue=8), reports=slow)
    assert got.choice == HERE and got.source is None and got.num_blocks == 0
    assert got.costs[FETCH] > got.costs[HERE]


def test_the_slower_end_of_the_link_sets_the_transfer_rate() -> None:
    reports = {"a": report("a"), "h": report("h", kv_transfer_bytes_per_s=2e7)}
    assert plan(stats("a"), stats("h", cached=960, queue=8), reports=reports).choice == HERE


def test_an_idle_holder_with_a_free_seat_takes_the_request_itself() -> None:
    # the lead has 2 s of prefill ahead; the holder has a free seat and nothing ahead
    got = plan(stats("a", prefill=2000), stats("h", cached=960, queue=2))
    assert got.choice == HOLDER and got.target == "h" and got.num_blocks == 0


def test_a_margin_keeps_the_ranked_choice_when_the_gain_is_small() -> None:
    # 3 blocks' gain is under the minimum; 4 at a margin of 0.99 is not enough either
    assert plan(stats("a"), stats("h", cached=48, queue=8)) is None
    tight = RoutingConfig(kv_transfer=True, kv_transfer_margin=0.99)
    assert plan(stats("a"), stats("h", cached=960, queue=8), cfg=tight).choice == HERE


def test_nothing_to_weigh_when_off_when_the_holder_leads_or_holds_no_more() -> None:
    assert plan(stats("a"), stats("h", cached=960), cfg=OFF) is None
    assert plan(stats("h", cached=960), stats("h", cached=960)) is None
    assert plan(stats("a", cached=960), stats("h", cached=960)) is None


def test_a_fetch_leaves_the_last_prompt_token_to_compute() -> None:
    got = plan(stats("a"), stats("h", cached=1024, queue=8), prompt=1024)
    assert got.num_blocks == 63  # (1024 - 1) // 16: the first token's logits need one token


def test_unreported_rates_fall_back_to_the_config() -> None:
    cfg = RoutingConfig(kv_transfer=True, kv_transfer_bytes_per_s=1e3)  # 1 kB/s: never fetch
    got = plan_fetch(stats("a"), stats("h", cached=960, queue=8), 1024, 16, cfg, lambda rid: None)
    assert got.choice == HERE


def test_the_best_holder_holds_the_most_ties_by_id() -> None:
    assert best_holder({"b": 32, "a": 32, "c": 16}) == "a"
    assert best_holder({"a": 0}) is None


# --- the decision ------------------------------------------------------------------------------
def _decide(cfg: RoutingConfig, ongoing: dict[str, int], hits: dict[str, int], seed: int = 0,
            reports=None, ids=None, **kw):  # fmt: skip
    reports = reports or {rid: report(rid) for rid in ongoing}
    ids = list(ongoing) if ids is None else ids
    return decide(
        Policy(cfg, random.Random(seed)), InflightLoad(), ids,
        lambda rid: (ongoing.get(rid, 0), reports.get(rid)), NOW, random.Random(seed),
        footprint_tokens=1100, hits=hits, prompt_tokens=1024, block_size=16, **kw,
    )  # fmt: skip


def test_a_spill_fetches_from_the_busy_holder_and_says_so() -> None:
    ongoing = {"a": 0, "b": 0, "h": 12}  # the holder is past its seats: load spills the request
    got = _decide(ON, ongoing, {"h": 960})
    assert got.lead in ("a", "b") and got.fetch == KVFetch("h", 60)
    assert got.reason(got.lead, ON) == "fetch"
    off = _decide(OFF, ongoing, {"h": 960})
    assert off.fetch is None and off.plan is None and off.reason(off.lead, ON) == "spill"
    assert off.tiers == got.tiers  # the ranking itself is unchanged


def test_with_the_holder_leading_nothing_is_fetched_and_the_ranking_is_unchanged() -> None:
    ongoing = {"a": 0, "b": 0, "h": 0}
    got = _decide(ON, ongoing, {"h": 960})
    assert got.lead == "h" and got.fetch is None
    assert got.tiers == _decide(OFF, ongoing, {"h": 960}).tiers


def test_the_holder_is_found_beyond_the_sampled_candidates() -> None:
    ids = [f"r{i}" for i in range(16)]
    ongoing = dict.fromkeys(ids, 0) | {"r15": 8}
    cfg = RoutingConfig(kv_transfer=True, max_candidates=2)
    # the hits name r15, which the sample keeps (a holder is always sampled); with hits naming
    # a replica not in `ids` at all (another router's view), it is still the fetch's source
    reports = {rid: report(rid) for rid in [*ids, "far"]}
    got = _decide(cfg, ongoing | {"far": 8}, {"far": 960}, reports=reports, ids=ids)
    assert got.fetch == KVFetch("far", 60) and got.lead != "far"


def test_a_hinted_source_outside_the_index_is_weighed_and_never_the_lead_itself() -> None:
    ongoing = {"a": 0, "b": 3}
    got = _decide(ON, ongoing, {}, preset=KVFetch("gone-draining", 60))
    assert got.fetch == KVFetch("gone-draining", 60)
    # the hint names the lead: nothing to fetch
    assert _decide(ON, ongoing, {}, preset=KVFetch("a", 60)).fetch is None


# --- a drained stream's continuation -----------------------------------------------------------
def test_a_drained_streams_continuation_fetches_from_the_draining_replica() -> None:
    pytest.importorskip("ray")
    from router.fanout import ReplicaCalls
    from router.migration import Migrations
    from tests.router.test_migration import ActorDiedError, Replicas, choice, no_pause  # noqa: F401

    def drained(message: str) -> ReplicaDraining:
        return ReplicaDraining(message, "r7")

    prompt = list(range(1, 40))  # 39 tokens + 2 delivered: 40 computed, 2 full blocks
    for cfg, script, expected in (
        (ON, [(2, drained)], KVFetch("r7", 2)),
        (OFF, [(2, drained)], None),
        (ON, [(2, ActorDiedError)], None),  # a lost replica's KV is gone with it
    ):
        replicas = Replicas(script)
        calls = ReplicaCalls(replicas, Policy(cfg), 16, Migrations(3))

        async def run(calls=calls):
            return [out async for out in calls.one_stream(choice(prompt))]

        import router.fanout as fanout

        saved, fanout.RETRY_PAUSE_S = fanout.RETRY_PAUSE_S, 0.0
        try:
            asyncio.run(run())
        finally:
            fanout.RETRY_PAUSE_S = saved
        first, second = replicas.sent
        assert first.kv_fetch is None and second.kv_fetch == expected


# --- PD: prefill replica, then decode replica, one stream ---------------------------------------
def _pd_run(streamed: bool, max_tokens: int = 6, monkeypatch=None):
    pytest.importorskip("ray")
    from router import fanout
    from router.fanout import ReplicaCalls
    from router.migration import Migrations
    from tests.router.test_migration import Replicas, choice

    monkeypatch.setattr(fanout, "replica_of", lambda request_id: "p0")
    prefill, decode = Replicas(), Replicas()
    calls = ReplicaCalls(decode, Policy(ON), 16, Migrations(3), prefill=prefill)
    job = choice([3] * 40, max_tokens=max_tokens)

    async def run():
        if streamed:
            return [out async for out in calls.one_stream(job)]
        return [out async for out in calls._call(job, streamed=False)]

    return asyncio.run(run()), prefill, decode


def test_pd_runs_the_prompt_on_a_prefill_replica_and_the_rest_on_a_decode_one(monkeypatch):
    from tests.router.test_migration import Replicas, calls, choice, joined, stream

    outs, prefill, decode = _pd_run(True, monkeypatch=monkeypatch)
    colocated = stream(calls(Replicas()), choice([3] * 40))
    assert joined(outs) == joined(colocated)  # the client's stream, unbroken
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5, 6]
    assert outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
    (first,), (rest,) = prefill.sent, decode.sent
    assert first.sampling.max_tokens == 1 and first.resume is None and first.kv_fetch is None
    assert rest.sampling.max_tokens == 6 and rest.resume.output_token_ids == [3000]
    assert rest.kv_fetch == KVFetch("p0", 2)  # 40 prompt tokens + 1: (41 - 1) // 16 blocks


def test_pd_unary_answers_both_phases_as_one_and_a_one_token_answer_stays_on_prefill(
    monkeypatch,
):
    (whole,), _, _ = _pd_run(False, monkeypatch=monkeypatch)
    assert whole.num_output_tokens == 6 and len(whole.new_token_ids) == 6
    assert whole.new_text.startswith("w3.0 w3.1 ") and whole.finish_reason == "length"
    outs, prefill, decode = _pd_run(True, max_tokens=1, monkeypatch=monkeypatch)
    assert len(prefill.sent) == 1 and decode.sent == [] and outs[-1].finish_reason == "length"


def test_pd_builds_a_prefill_deployment_beside_the_decode_one() -> None:
    pytest.importorskip("ray")
    from cluster.app import llm_deployments
    from cluster.config import ClusterConfig

    config = ClusterConfig.model_validate({"pd": {"prefill_replicas": 1, "decode_replicas": 3}})
    got = llm_deployments(config)
    name = config.model_name()
    assert list(got) == [name, name + "#prefill"]
    assert [(o["name"], o["num_replicas"]) for _, o in got.values()] == [
        ("LLMServer", 3), ("LLMServer-prefill", 1),
    ]  # fmt: skip
    assert config.replicas_per_machine() == 4
    with pytest.raises(ValueError, match="pd needs stepserve's router"):
        ClusterConfig.model_validate(
            {"pd": {"prefill_replicas": 1, "decode_replicas": 1}, "routing": {"policy": "pow2"}}
        )
