"""Routing with LoRA adapters: the adapter-load term of the score (holders win ties and
near-ties, busy holders spill), the router's tally of adapters it sent (current before the next
report, alone when reports are stale), sampled candidates keeping holders, the "lora" decision
reason, and the KV index hashing a prompt from its adapter's root as the replica does."""

from __future__ import annotations

import random

from replica.contracts import RoutingStats
from replica.request import EngineRequest, LoRARequest, Request, SamplingParams
from router.decision import decide
from router.inflight import InflightLoad, replica_stats
from router.kv_index import KVIndex
from router.kv_routing import REASONS, KVRouting, exposition, register_kv_routing
from router.policy import (
    Policy,
    ReplicaStats,
    RequestSize,
    RoutingConfig,
    decision_reason,
    holds_lora,
    rank_replicas,
)

AWARE = RoutingConfig(weight_lora_load=2.0)
UNAWARE = RoutingConfig(weight_lora_load=0.0)
NOW = 100.0


def fresh(rid: str, ongoing: int = 0, loaded: bool | None = None, **kw) -> ReplicaStats:
    return ReplicaStats(rid, ongoing, stats_age_s=0.5, lora_loaded=loaded, **kw)


def lead(replicas: list[ReplicaStats], cfg: RoutingConfig = AWARE) -> str:
    """The replica the router sends the request to: the best tier's fewest-requests replica."""
    from router.policy import lead_replica

    tiers = rank_replicas(replicas, cfg)
    return lead_replica(tiers[0], replicas, cfg, random.Random(0))[0]


# --- the score term --------------------------------------------------------------------------
def test_a_holder_wins_at_equal_load() -> None:
    replicas = [fresh("a", 2, loaded=False), fresh("b", 2, loaded=True), fresh("c", 2, False)]
    assert rank_replicas(replicas, AWARE)[0] == ["b"]
    for seed in range(10):  # unaware: any of the three, holding or not
        tiers = rank_replicas(replicas, UNAWARE, rng=random.Random(seed))
        assert sorted(tiers[0]) == ["a", "b", "c"]


def test_a_holder_wins_a_near_tie_that_its_tier_would_give_to_the_idler_replica() -> None:
    # holder 1 + 0, other 0 + 1.2: within score_tolerance (0.5), where a tier's lead is its
    # fewest-requests replica; the holder heads a tier of its own
    cfg = RoutingConfig(weight_lora_load=1.2)
    replicas = [fresh("other", 0, loaded=False), fresh("holder", 1, loaded=True)]
    assert lead(replicas, UNAWARE) == "other"
    assert lead(replicas, cfg) == "holder"
    assert rank_replicas(replicas, cfg) == [["holder"], ["other"]]


def test_a_busy_holder_spills_once_its_load_exceeds_the_weight() -> None:
    for holder_queue, expected in ((1, "holder"), (2, "holder"), (3, "other")):
        replicas = [fresh("holder", holder_queue, loaded=True), fresh("other", 0, loaded=False)]
        assert lead(replicas) == expected, holder_queue
    spill = [fresh("holder", 3, loaded=True), fresh("other", 0, loaded=False)]
    assert decision_reason(spill, AWARE, "other", RequestSize()) == "load"
    near = [fresh("holder", 2, loaded=True), fresh("other", 0, loaded=False)]
    assert decision_reason(near, AWARE, "holder", RequestSize()) == "lora"
    assert "lora" in REASONS


def test_a_request_without_an_adapter_ranks_by_load_alone() -> None:
    stats = replica_stats("a", 1, RoutingStats("a", ts=NOW, loras=("x",)), InflightLoad(), 0, NOW)
    assert stats.lora_loaded is None and holds_lora(stats, AWARE) is None
    replicas = [fresh("a", 1), fresh("b", 0)]
    assert rank_replicas(replicas, AWARE) == rank_replicas(replicas, UNAWARE)


# --- what the router knows: reports and its own tally ------------------------------------------
def test_the_report_and_sends_since_say_who_holds_an_adapter() -> None:
    load = InflightLoad()
    report = RoutingStats("a", ts=NOW - 0.5, loras=("x", "y"))

    def held(name: str) -> bool | None:
        return holds_lora(replica_stats("a", 0, report, load, 0, NOW, lora=name), AWARE)

    assert held("x") is True and held("z") is False
    load.adapter_sent("a", "z", NOW - 0.2)  # after the report: loaded for that request
    assert held("z") is True
    load.adapter_sent("a", "w", NOW - 0.9)  # before it, and the report no longer lists it
    assert held("w") is False


def test_the_next_request_for_an_adapter_follows_the_first_before_any_report() -> None:
    policy, load = Policy(AWARE, random.Random(0)), InflightLoad()
    reports = {rid: RoutingStats(rid, ts=NOW - 0.1) for rid in ("a", "b", "c", "d")}
    places = []
    for i in range(3):
        decision = decide(
            policy, load, list(reports), lambda rid: (0, reports[rid]), NOW + i * 0.01,
            random.Random(i), lora="x",
        )  # fmt: skip
        load.adapter_sent(decision.lead, "x", NOW + i * 0.01)
        places.append(decision.lead)
    assert len(set(places)) == 1, places


def test_stale_stats_drop_to_the_routers_tally() -> None:
    load = InflightLoad()
    stale = RoutingStats("a", ts=NOW - 60, loras=("x",))
    stats = replica_stats("a", 0, stale, load, 0, NOW, lora="x")
    assert stats.lora_loaded is True and holds_lora(stats, AWARE) is False  # report too old
    load.adapter_sent("a", "x", NOW - 50)
    assert holds_lora(replica_stats("a", 0, stale, load, 0, NOW, lora="x"), AWARE) is True
    never = replica_stats("b", 0, None, load, 0, NOW, lora="x")  # no report yet
    assert holds_lora(never, AWARE) is False


def test_the_tally_keeps_the_latest_adapters_per_replica_and_forgets_gone_replicas() -> None:
    load = InflightLoad(lora_slots=2)
    for t, name in enumerate(("x", "y", "z")):
        load.adapter_sent("a", name, float(t))
    assert load.adapter_sent_at("a", "x") is None  # the oldest of three, over two slots
    assert load.adapter_sent_at("a", "z") == 2.0
    load.forget_missing(["b"])
    assert load.adapter_sent_at("a", "z") is None


# --- sampled candidates ----------------------------------------------------------------------
def test_sampled_candidates_keep_the_holders_of_the_adapter() -> None:
    ids = [f"r{i}" for i in range(100)]
    holders = ["r7", "r42"]
    policy = Policy(RoutingConfig(max_candidates=8), random.Random(0))
    for _ in range(50):
        picked = policy.candidates(ids, None, None, holders)
        assert len(picked) == 8 and set(holders) <= set(picked)
    unaware = Policy(RoutingConfig(max_candidates=8, weight_lora_load=0), random.Random(0))
    kept = sum(set(holders) <= set(unaware.candidates(ids, None, None, holders)) for _ in range(50))
    assert kept < 10  # left to chance: 8 of 100 rarely hold both


def test_decide_finds_the_holders_when_it_samples() -> None:
    ids = [f"r{i}" for i in range(64)]
    reports = {
        rid: RoutingStats(rid, ts=NOW - 0.1, loras=("x",) if rid == "r9" else ()) for rid in ids
    }
    policy = Policy(RoutingConfig(max_candidates=4), random.Random(1))
    for seed in range(20):
        decision = decide(
            policy, InflightLoad(), ids, lambda rid: (0, reports[rid]), NOW, random.Random(seed),
            lora="x",
        )  # fmt: skip
        assert decision.lead == "r9"
        assert decision.reason("r9", policy.cfg) == "load"  # equal load: the tie went its way


# --- the KV index hashes a prompt per adapter --------------------------------------------------
def _replica_hashes(prompt: list[int], lora: LoRARequest | None, block_size: int) -> list[int]:
    request = Request(EngineRequest(prompt, SamplingParams(max_tokens=1), "r", lora=lora))
    request.update_block_hashes(block_size)
    return request.block_hashes


def test_prompt_hashes_differ_by_adapter_and_equal_the_replicas() -> None:
    index = KVIndex(block_size=4)
    prompt = list(range(10, 27))  # 17 tokens: 4 usable blocks
    x, y = LoRARequest("x", "/adapters/x"), LoRARequest("y", "/adapters/y")
    by_adapter = {name: index.prompt_hashes(prompt, lora) for name, lora in
                  (("base", None), ("x", x), ("y", y))}  # fmt: skip
    assert len({tuple(h) for h in by_adapter.values()}) == 3
    assert all(not set(a) & set(b) for a in by_adapter.values() for b in by_adapter.values()
               if a is not b)  # fmt: skip
    for name, lora in (("base", None), ("x", x), ("y", y)):
        assert by_adapter[name] == _replica_hashes(prompt, lora, 4)
    assert index.prompt_hashes(prompt) == by_adapter["base"]


def test_an_adapter_request_predicts_hits_only_on_kv_computed_under_it() -> None:
    from replica.api import STORED, KVEventBatch

    routing = KVRouting("app", block_size=4, start=False)
    routing.set_live(["a", "b"])
    prompt = list(range(10, 27))
    x = LoRARequest("x", "/adapters/x")
    on_a = [(STORED, h) for h in _replica_hashes(prompt, x, 4)]
    on_b = [(STORED, h) for h in _replica_hashes(prompt, None, 4)]
    routing.index.apply("a", KVEventBatch(1, tuple(on_a)))
    routing.index.apply("b", KVEventBatch(1, tuple(on_b)))
    assert routing.hit_tokens(prompt, ["a", "b"], x) == {"a": 16}
    assert routing.hit_tokens(prompt, ["a", "b"]) == {"b": 16}
    assert routing.hit_tokens(prompt, ["a", "b"], LoRARequest("x", "/elsewhere")) == {}


def test_the_decisions_metric_counts_lora_decisions() -> None:
    routing = KVRouting("app", block_size=4, start=False)
    register_kv_routing(routing)
    routing.routed("req-1", 0, "lora")
    text = exposition("ingress-0").decode()
    assert 'reason="lora"}' in text
    assert routing.snapshot()["decisions"]["lora"] == 1
