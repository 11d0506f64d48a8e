"""One routing decision, as the Ray request router (router/request_router.py) and the simulator
(sim/) both make it: sample the candidates (`Policy.candidates`), read what the router knows of
each (`replica_stats`: Ray's in-flight count, the replica's last report, the router's own tally
and prefill estimate, the KV index's hit, whether it holds the request's LoRA adapter), rank them (`Policy.rank`) and pick the best tier's
lead (`lead_replica`). Pure: no Ray, no clock of its own; the caller says how to observe a
replica and what time it is, and acts on the result (notes the choice, sends the request)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from replica.api import KVFetch, RoutingStats
from router.inflight import InflightLoad, replica_stats
from router.kv_transfer import FETCH, HOLDER, FetchPlan, best_holder, plan_fetch
from router.policy import (
    Policy,
    ReplicaStats,
    RequestSize,
    RoutingConfig,
    decision_reason,
    lead_replica,
)

# What a router can see of one replica: Ray's in-flight count there and its last recorded stats
# (None before its first report, or for a replica it does not route to).
Observe = Callable[[str], tuple[int, RoutingStats | None]]


@dataclass
class Decision:
    """Ranked tiers of replica ids, best first: the first tier is the lead alone (the replica
    the request goes to), then the rest of the best tier, then the other tiers. Empty: no
    candidate. `stats` are what the ranking read, `hits` the KV index's hit tokens per
    replica, `footprint_tokens` the request's prompt + max_tokens. `fetch`: the prefix blocks
    the lead is to bring from their holder first (routing.kv_transfer), `plan` the cost
    model's weighing (None: nothing to weigh)."""

    tiers: list[list[str]]
    stats: list[ReplicaStats]
    hits: Mapping[str, int] = field(default_factory=dict)
    footprint_tokens: int = 0
    fetch: KVFetch | None = None
    plan: FetchPlan | None = None

    @property
    def lead(self) -> str | None:
        return self.tiers[0][0] if self.tiers else None

    def reason(self, replica_id: str, cfg: RoutingConfig) -> str | None:
        """Why `replica_id` won ("fetch": it fetches the prefix from its holder; else "load",
        "cache", "spill" or "lora": `decision_reason`); None when it was not among the
        candidates (Ray sent the request elsewhere)."""
        if not any(s.replica_id == replica_id for s in self.stats):
            return None
        if self.fetch is not None and replica_id == self.lead:
            return "fetch"
        size = RequestSize.of(self.stats, self.footprint_tokens)
        return decision_reason(self.stats, cfg, replica_id, size)


def decide(
    policy: Policy,
    load: InflightLoad,
    replica_ids: Sequence[str],
    observe: Observe,
    now: float,
    rng: random.Random,
    *,
    prefix: int | None = None,
    footprint_tokens: int = 0,
    hits: Mapping[str, int] | None = None,
    lora: str | None = None,
    prompt_tokens: int = 0,
    block_size: int = 16,
    preset: KVFetch | None = None,
) -> Decision:
    """Rank `replica_ids` for one request (prefix key `prefix`, KV footprint
    `footprint_tokens`, `hits`: cached prompt tokens per replica, `lora`: its adapter's name)
    by `policy` over what `observe` and `load` say at `now`; `rng` breaks ties within the best
    tier. With routing.kv_transfer, weigh fetching the prompt's cached prefix (`prompt_tokens`
    long, blocks of `block_size`) to the lead from its best holder in `hits` (which may name
    replicas beyond `replica_ids`: every replica the router knows), or from `preset`'s source
    (a holder outside the index: a draining replica that handed a stream back)."""
    hits = hits or {}
    holders: list[str] = []
    if lora is not None and 0 < policy.cfg.max_candidates < len(replica_ids):
        holders = lora_holders(replica_ids, observe, load, lora)  # kept in the sample
    if policy.cfg.kv_transfer and hits:  # hits may name holders beyond `replica_ids`
        known = set(replica_ids)
        hits_here = {rid: tokens for rid, tokens in hits.items() if rid in known}
    else:
        hits_here = hits
    ids = policy.candidates(list(replica_ids), prefix, hits_here, holders)
    prefill = load.prefill_by_replica(now, ids)
    stats = []
    for rid in ids:
        ongoing, recorded = observe(rid)
        stats.append(
            replica_stats(
                rid, ongoing, recorded, load, prefill.get(rid, 0.0), now, hits.get(rid, 0), lora
            )
        )
    ranked = policy.rank(stats, prefix, footprint_tokens)
    if not ranked:
        return Decision([], stats, hits, footprint_tokens)
    lead, *rest = lead_replica(ranked[0], stats, policy.cfg, rng)
    tiers = [[lead], rest, *ranked[1:]] if rest else [[lead], *ranked[1:]]
    decision = Decision(tiers, stats, hits, footprint_tokens)
    if policy.cfg.kv_transfer and prompt_tokens > 0 and (hits or preset is not None):
        weigh_fetch(decision, policy.cfg, load, observe, now, prompt_tokens, block_size, preset)
    return decision


def weigh_fetch(
    decision: Decision,
    cfg: RoutingConfig,
    load: InflightLoad,
    observe: Observe,
    now: float,
    prompt_tokens: int,
    block_size: int,
    preset: KVFetch | None,
) -> None:
    """Apply the cost model (router/kv_transfer.py) to a ranked `decision`: attach a fetch to
    its lead, or make the holder the lead, when the model says so; else leave it as ranked."""
    by_id = {s.replica_id: s for s in decision.stats}
    lead = by_id[decision.lead]
    if preset is not None:
        source, holder_tokens = preset.source, preset.num_blocks * block_size
    else:
        source, holder_tokens = best_holder(decision.hits), None
    if source is None or source == lead.replica_id:
        return
    holder = by_id.get(source)
    if holder is None and preset is not None:  # a replica the router no longer routes to
        holder = ReplicaStats(source, ongoing=0)
    elif holder is None:  # not among the candidates: what the router knows of it
        ongoing, recorded = observe(source)
        prefill = load.prefill_by_replica(now, [source]).get(source, 0.0)
        cached = decision.hits.get(source, 0)
        holder = replica_stats(source, ongoing, recorded, load, prefill, now, cached)
    plan = plan_fetch(
        lead, holder, prompt_tokens, block_size, cfg, lambda rid: observe(rid)[1], holder_tokens
    )
    decision.plan = plan
    if plan is None:
        return
    if plan.choice == FETCH:
        decision.fetch = KVFetch(plan.source, plan.num_blocks)
    elif plan.choice == HOLDER:
        if holder.replica_id not in by_id:
            decision.stats.append(holder)
        rest = [[rid for rid in tier if rid != source] for tier in decision.tiers]
        decision.tiers = [[source]] + [tier for tier in rest if tier]


def lora_holders(
    replica_ids: Sequence[str], observe: Observe, load: InflightLoad, lora: str
) -> list[str]:
    """The replicas that hold adapter `lora` by their last report or this router's tally (a
    pass over every replica's stats: only when the candidates are a sample)."""
    out = []
    for rid in replica_ids:
        recorded = observe(rid)[1]
        reported = recorded is not None and lora in recorded.loras
        if reported or load.adapter_sent_at(rid, lora) is not None:
            out.append(rid)
    return out
