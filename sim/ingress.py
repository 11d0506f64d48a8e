"""A simulated ingress replica: its own routing policy state, in-flight tally and (with
routing.kv_events) KV index, deciding each request with the Ray router's own code
(`router.decision.decide`). Ray's part is modelled here: its in-flight count per replica,
`max_ongoing_requests` (a request waits at the router while every replica is full)."""

from __future__ import annotations

import random
from collections import deque

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
        if not open_:
            return False
        by_id = {r.rid: r for r in open_ if r.ongoing < cap}
        if not by_id:
            return False
        hits: dict[str, int] = {}
        if self.index is not None:
            if req.hashes is None:
                req.hashes = self.index.prompt_hashes(req.spec.prompt_ids, req.lora)
            hits = self.index.hit_tokens(req.hashes, by_id)
        lora = req.lora.name if req.lora is not None else None
        decision = decide(
            self.policy, self.load, list(by_id),
            lambda rid: (by_id[rid].ongoing, by_id[rid].stats_for_router(now)),
            now, self.rng, prefix=req.prefix_key, footprint_tokens=req.footprint, hits=hits,
            lora=lora,
        )  # fmt: skip
        self.decisions += 1
        if not decision.tiers:
            return False
        # as the router: the best tier's replica with the fewest requests, ties at random
        chosen = by_id[decision.lead]
        if self.index is not None:
            req.predicted_hit = hits.get(chosen.rid, 0)
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
        sim.at(now + sim.settings.net_latency_s, chosen.receive, req)
        return True
