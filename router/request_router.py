"""LoadAwareRouter: plugs router/policy.py into Ray Serve as a custom RequestRouter. Signals:
Ray's own fresh per-replica in-flight count, this router's own tally of the tokens it has in
flight on each replica and of which of them are still in prefill (fed by Ray's
on_request_routed hook, and by the ingress's `note_first_token` and `note_finished`, or by Ray's
on_request_completed for requests the ingress did not send), plus the
stats each replica records about once a second (waiting, running, KV usage, recent
preemptions, token budget).

Ray builds the router inside the process that holds the deployment handle, the ingress replica,
and gives user code no reference to it: each router registers its tally with router/policy.py
(`register_inflight`), where the ingress's notes reach it. Not in
this module: Ray pickles the router's module by value, so every router class it unpickles has
its own copy of this module's globals."""

from __future__ import annotations

import random
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from router.policy import (
    InflightLoad,
    Policy,
    ReplicaStats,
    RoutingConfig,
    prompt_tokens,
    register_inflight,
    request_tokens,
)


def _payload(pending_request: PendingRequest | None) -> object:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]


class LoadAwareRouter(RequestRouter):
    def initialize_state(self, routing: dict | None = None, **_: object) -> None:
        self.routing_config = RoutingConfig.model_validate(routing or {})
        self.policy = Policy(self.routing_config)
        self.inflight = InflightLoad()
        self._rng = random.Random()
        register_inflight(self.inflight)

    def _stats_of(
        self, replica: RunningReplica, now: float, prefill: dict[str, float]
    ) -> ReplicaStats:
        rid = replica.replica_id.unique_id
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        recorded = replica.routing_stats or {}
        ts = recorded.get("ts")
        return ReplicaStats(
            replica_id=rid,
            ongoing=int(ongoing or 0),
            waiting=int(recorded.get("waiting", 0)),
            running=int(recorded.get("running", 0)),
            kv_usage=float(recorded.get("kv_usage", 0.0)),
            preemptions_per_s=float(recorded.get("preemptions_per_s", 0.0)),
            max_num_seqs=int(recorded.get("max_num_seqs", 0)),
            stats_age_s=(now - ts) if ts else float("inf"),
            inflight_requests=self.inflight.requests(rid),
            inflight_tokens=self.inflight.tokens(rid),
            completed_since_stats=self.inflight.completed_since(rid, ts) if ts else 0,
            prefill_tokens=prefill.get(rid, 0.0),
            max_num_batched_tokens=int(recorded.get("max_num_batched_tokens", 0)),
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        now = time.time()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        prefill = self.inflight.prefill_by_replica(now)
        stats = [self._stats_of(r, now, prefill) for r in candidate_replicas]
        payload = _payload(pending_request)
        prefix = payload.get("prefix_key") if isinstance(payload, dict) else None
        tiers = self.policy.rank(stats, prefix, request_tokens(payload))
        ranked = []
        for tier in tiers:
            replicas = [by_id[rid] for rid in tier if rid in by_id]
            # Ray takes the tier's replica with the fewest in-flight requests and, among equals,
            # the first: shuffle so ties do not always land on the same replica
            self._rng.shuffle(replicas)
            if replicas:
                ranked.append(replicas)
        return ranked

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.inflight.forget_missing([r.replica_id.unique_id for r in replicas])

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        payload = _payload(pending_request)
        tokens = request_tokens(payload)
        if tokens:
            self.inflight.routed(
                pending_request.metadata.internal_request_id,
                replica_id.unique_id,
                tokens,
                prompt_tokens=prompt_tokens(payload),
                # the ingress reports this request's first token and its end (policy.py)
                key=payload.get("request_id") if payload.get("reports_progress") else None,
                now=time.time(),
            )

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.inflight.completed(internal_request_id, replica_id.unique_id, time.time())
