"""A simulated ingress replica: its own routing policy state, in-flight tally and (with
routing.kv_events) KV index, deciding each request with the Ray router's own code
(`router.decision.decide`). Ray's part is modelled here: its in-flight count per replica,
`max_ongoing_requests` (a request waits at the router while every replica is full)."""

from __future__ import annotations

import random
from collections import deque

from replica.request import KVFetch
from router.decision import decide
from router.inflight import InflightLoad
from router.kv_index import KVIndex
from router.policy import Policy
from sim.replica import SimRequest


class SimIngress:
    """One ingress replica: its own routing policy state and in-flight tally."""

    def __init__(self, sim, index: int) -> None:
        self.sim = sim
        self.number = index  # which ingress of the cluster
        self.policy = Policy(sim.config.routing, random.Random(sim.rng.random()))
        cfg = sim.config
        self.load = InflightLoad(lora_slots=cfg.engine.lora_capacity)
        # the mirror of every replica's prefix cache (with routing.kv_events)
        self.index = KVIndex(cfg.engine.block_size) if cfg.routing.kv_events else None
        self.rng = random.Random(sim.rng.random())
        self.pending: deque[SimRequest] = deque()
        self.decisions = 0

    def route(self, req: SimRequest, now: float) -> bool:
        """Send `req` to a replica (True) or leave it waiting for capacity (False)."""
        sim = self.sim
        cap = sim.config.max_ongoing_requests
        open_ = sim.routable
        if sim.pd is not None:  # PD: prompts go to the prefill replicas
            open_ = [r for r in open_ if r.role == "prefill"]
            req.phase = "prefill"
        if not open_:
            return False
        by_id = {r.rid: r for r in open_ if r.ongoing < cap}
        if not by_id:
            return False
        everyone = {r.rid: r for r in open_}
        hits: dict[str, int] = {}
        if self.index is not None:
            if req.hashes is None:
                req.hashes = self.index.prompt_hashes(req.spec.prompt_ids, req.lora)
            # with kv_transfer, a holder may be full and still send its blocks: ask of everyone
            asked = everyone if sim.config.routing.kv_transfer else by_id
            hits = self.index.hit_tokens(req.hashes, asked)
        lora = req.lora.name if req.lora is not None else None
        decision = decide(
            self.policy, self.load, list(by_id),
            lambda rid: (everyone[rid].ongoing, everyone[rid].stats_for_router(now)),
            now, self.rng, prefix=req.prefix_key, footprint_tokens=req.footprint, hits=hits,
            lora=lora, prompt_tokens=len(req.spec.prompt_ids),
            block_size=sim.config.engine.block_size,
        )  # fmt: skip
        self.decisions += 1
        if not decision.tiers:
            return False
        # as the router: the best tier's replica with the fewest requests, ties at random
        chosen = everyone[decision.lead]
        req.fetch = decision.fetch
        if chosen.ongoing >= cap:  # the cost model's holder is full: Ray takes the next tier's
            chosen = next(by_id[rid] for tier in decision.tiers for rid in tier if rid in by_id)
            req.fetch = None
        if self.index is not None:
            req.predicted_hit = hits.get(chosen.rid, 0)
            if decision.fetch is not None:
                req.predicted_hit = decision.fetch.num_blocks * sim.config.engine.block_size
            req.reason = decision.reason(chosen.rid, sim.config.routing)
        req.replica = chosen
        req.routed_at = now
        chosen.ongoing += 1
        self.load.routed(
            req.rid, chosen.rid, req.footprint, prompt_tokens=len(req.spec.prompt_ids),
            key=req.rid, now=now,
        )  # fmt: skip
        if lora is not None:
            self.load.adapter_sent(chosen.rid, lora, now)
        sim.at(now + sim.hop(), chosen.receive, req)
        return True

    def route_decode(self, req: SimRequest, prefill, now: float) -> None:
        """PD: send `req`, its first token made on `prefill`, to the decode replica the load
        ranking picks (no cache to weigh: its KV comes from the prefill replica), with a fetch
        of its prompt's blocks from there. A decode replica takes it even when full (its queue
        waits: the prompt is paid for)."""
        sim = self.sim
        decode = {r.rid: r for r in sim.routable if r.role == "decode"}
        req.phase = "decode"
        decision = decide(
            self.policy, self.load, list(decode),
            lambda rid: (decode[rid].ongoing, decode[rid].stats_for_router(now)),
            now, self.rng, footprint_tokens=req.footprint,
        )  # fmt: skip
        chosen = decode[decision.lead]
        block_size = sim.config.engine.block_size
        req.fetch = KVFetch(prefill.rid, len(req.spec.prompt_ids) // block_size)
        req.replica = chosen
        chosen.ongoing += 1
        self.load.routed(req.rid, chosen.rid, req.footprint, prompt_tokens=0, key=req.rid, now=now)
        self.load.first_token(req.rid, now)  # nothing of it left to prefill there
        sim.at(now + sim.hop(), chosen.receive, req)
