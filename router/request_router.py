"""LoadAwareRouter: plugs the routing decision (router/decision.py, scored by router/policy.py)
into Ray Serve as a custom RequestRouter. Signals:
Ray's own fresh per-replica in-flight count, this router's own tally of the tokens it has in
flight on each replica and of which of them are still in prefill (fed by Ray's
on_request_routed hook, and by the ingress's `note_first_token` and `note_finished`, or by Ray's
on_request_completed for requests the ingress did not send), plus the
stats each replica records about once a second (waiting, running, KV usage, recent
preemptions, token budget, the LoRA adapters it holds loaded).

The best tier's first replica is picked here, not by Ray, and the request counts there from
that moment (`InflightLoad.chosen`) until Ray's on_request_routed says where it went: Ray
routes a burst of requests in one pass of its event loop and reports each only after its
replica has accepted it, so without the choice every request of a burst would be ranked on the
same numbers and land on the same replica.

Ray builds the router inside the process that holds the deployment handle, the ingress replica,
and gives user code no reference to it: each router registers its tally with router/inflight.py
(`register_inflight`), where the ingress's notes reach it. Not in
this module: Ray pickles the router's module by value, so every router class it unpickles has
its own copy of this module's globals.

What crosses into here is typed (replica/api.py): the request being routed is the
ingress's `GenerateRequest`, a replica's recorded stats are a `RoutingStats`."""

from __future__ import annotations

import dataclasses
import random
import time

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from replica.api import GenerateRequest, RoutingStats, routing_span
from router.decision import Decision, decide
from router.inflight import InflightLoad, register_inflight, register_router
from router.kv_routing import KVRouting, register_kv_routing
from router.policy import Policy, RoutingConfig


def _request(pending_request: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest being routed (None for other calls: model_info, stats, ...)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerateRequest) else None


def prompt_tokens(request: GenerateRequest) -> int:
    """The tokens a replica computes before the request's next token: its prompt, and for a
    continued stream (migration) the output it resumes from."""
    resumed = len(request.resume.output_token_ids) if request.resume is not None else 0
    return len(request.prompt_token_ids) + resumed


def healthy_replicas(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """The replicas whose last recorded stats do not say their engine is dead or stalled (all
    of them when none qualifies: Serve is replacing them, and a request waits rather than
    fails)."""
    healthy = [r for r in replicas if _recorded_healthy(r)]
    return healthy or replicas


def _recorded_healthy(replica: RunningReplica) -> bool:
    stats = RoutingStats.from_dict(replica.routing_stats)
    return stats is None or stats.healthy


class LoadAwareRouter(RequestRouter):
    def initialize_state(
        self,
        routing: dict | None = None,
        block_size: int = 16,
        lora_capacity: int = 4,
        **_: object,
    ) -> None:
        register_router(self)
        self.routing_config = RoutingConfig.model_validate(routing or {})
        self.block_size = block_size
        self.policy = Policy(self.routing_config)
        # adapters a replica holds: its max_cpu_loras, for the router's tally of those it sent
        self.inflight = InflightLoad(lora_slots=lora_capacity)
        self._rng = random.Random()
        register_inflight(self.inflight)
        self.kv: KVRouting | None = None
        self._decisions: dict[str, Decision] = {}  # request id -> its decision (KV routing)
        self._traced: dict[str, tuple[float, Decision]] = {}  # request id -> (when, decision)
        # replicas a call found dead or unreachable (Serve's controller lists them until it
        # declares them dead, a node's loss takes seconds): id -> the time stamp of the stats
        # the replica had recorded then (-1: dead for good)
        self._lost: dict[str, float] = {}
        if self.routing_config.kv_events:
            deployment = getattr(self, "_deployment_id", None)
            app = getattr(deployment, "app_name", None)
            if app is None:
                try:
                    app = serve.get_replica_context().app_name
                except Exception:
                    app = "default"
            # the poller starts with the first request this router routes (a handle that only
            # makes other calls, as a driver's, never polls)
            self.kv = KVRouting(app, block_size, self.routing_config.kv_events_poll_s, start=False)
            register_kv_routing(self.kv)

    def _observe(self, replica: RunningReplica | None) -> tuple[int, RoutingStats | None]:
        """Ray's in-flight count on `replica` and the stats it last recorded (nothing of a
        replica this router does not route to: a fetch's draining source)."""
        if replica is None:
            return 0, None
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        return int(ongoing or 0), RoutingStats.from_dict(replica.routing_stats)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        now = time.time()
        request = _request(pending_request)
        candidate_replicas = healthy_replicas(self._reachable(candidate_replicas))
        if request is None:
            # a control call (model_info, stats): no load worth balancing, and ranking it by
            # load would send every one to the same idlest replica; one replica per tier, in
            # random order, so each is asked in turn (Ray would otherwise pick the tier's
            # replica with the fewest in-flight requests)
            order = list(candidate_replicas)
            self._rng.shuffle(order)
            return [[replica] for replica in order]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        hits: dict[str, int] = {}
        # the cache matters only between replicas: with one, the index is not kept (kv_routing)
        use_kv = self.kv is not None and len(by_id) >= 2
        if self.kv is not None:
            self.kv.start()
        if use_kv:
            hits = self.kv.hit_tokens(request.prompt_token_ids, list(by_id), request.lora)
        lora = request.lora.name if request.lora is not None else None
        decision = decide(
            self.policy, self.inflight, list(by_id), lambda rid: self._observe(by_id.get(rid)),
            now, self._rng, prefix=request.prefix_key,
            footprint_tokens=request.footprint_tokens, hits=hits, lora=lora,
            prompt_tokens=prompt_tokens(request), block_size=self.block_size,
            preset=request.kv_fetch,
        )  # fmt: skip
        if self.routing_config.kv_transfer and decision.fetch != request.kv_fetch:
            # what the lead fetches first (or, for a hinted fetch the model turned down, nothing):
            # Ray sends the pending request's arguments as they are after this choice
            pending_request.args[0] = dataclasses.replace(request, kv_fetch=decision.fetch)
        if use_kv and request.reports_progress:
            self._decisions[request.request_id] = decision  # for on_request_routed
        if request.traceparent is not None:  # traced: its routing span at on_request_routed
            if len(self._traced) >= 4096:  # sends never routed (cancelled) go eventually
                self._traced.pop(next(iter(self._traced)))
            self._traced[request.request_id] = (now, decision)
        if not decision.tiers:
            return []
        # the request goes to the lead, chosen here and counted there at once
        # (InflightLoad.chosen): the rest of a burst sees it (module docstring)
        self.inflight.chosen(
            pending_request.metadata.internal_request_id,
            decision.lead,
            request.footprint_tokens,
            now,
        )
        if lora is not None:  # the lead loads it for this request: the next one sees it held
            self.inflight.adapter_sent(decision.lead, lora, now)
        ranked = [[by_id[decision.lead]]]
        for tier in decision.tiers[1:]:
            replicas = [by_id[rid] for rid in tier]
            # Ray takes a tier's replica with the fewest in-flight requests and, among equals,
            # the first: shuffle so ties do not always land on the same replica
            self._rng.shuffle(replicas)
            ranked.append(replicas)
        return ranked

    def _reachable(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        """The replicas no call has found lost (all of them when every one was: a request
        waits for Serve to replace them rather than fails). An unreachable replica is trusted
        again once Serve's controller brings stats it recorded later (its own clock: no skew
        between nodes)."""
        if not self._lost:
            return replicas
        kept = []
        for replica in replicas:
            rid = replica.replica_id.unique_id
            since = self._lost.get(rid)
            if since is not None:
                stats = RoutingStats.from_dict(replica.routing_stats)
                if since < 0 or stats is None or stats.ts <= since:  # nothing newer
                    continue
                del self._lost[rid]  # it answered since
            kept.append(replica)
        return kept or replicas

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._lost[replica_id.unique_id] = -1.0  # dead for good (actor ids are not reused)

    def on_replica_actor_unavailable(self, replica_id) -> None:
        super().on_replica_actor_unavailable(replica_id)
        replica = self._replicas.get(replica_id)
        stats = RoutingStats.from_dict(replica.routing_stats) if replica is not None else None
        self._lost.setdefault(replica_id.unique_id, stats.ts if stats is not None else 0.0)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = [r.replica_id.unique_id for r in replicas]
        self._lost = {rid: ts for rid, ts in self._lost.items() if rid in live}
        self.inflight.forget_missing(live)
        if self.kv is not None:  # a replica that left (died, replaced) leaves the index at once
            self.kv.set_live(live)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request = _request(pending_request)
        if request is not None and self.kv is not None:
            decision = self._decisions.pop(request.request_id, None)
            if decision is not None:
                rid = replica_id.unique_id
                reason = decision.reason(rid, self.routing_config)
                if reason is not None:
                    predicted = decision.hits.get(rid, 0)
                    if reason == "fetch":  # what it will hold once the fetch is in
                        predicted = decision.fetch.num_blocks * self.block_size
                    self.kv.routed(request.request_id, predicted, reason)
        traced = self._traced.pop(request.request_id, None) if request is not None else None
        if traced is not None:
            rid = replica_id.unique_id
            reason = traced[1].reason(rid, self.routing_config)
            routing_span(request, traced[0], rid, reason, len(traced[1].stats))
        if request is not None and request.lora is not None:  # where it went, if not the lead
            self.inflight.adapter_sent(replica_id.unique_id, request.lora.name, time.time())
        if request is not None:
            self.inflight.routed(
                pending_request.metadata.internal_request_id,
                replica_id.unique_id,
                request.footprint_tokens,
                prompt_tokens=request.num_prompt_tokens,
                # the ingress reports this request's first token and its end (inflight.py)
                key=request.request_id if request.reports_progress else None,
                now=time.time(),
            )

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.inflight.completed(internal_request_id, replica_id.unique_id, time.time())
