"""LoadAwareRouter: plugs router/policy.py into Ray Serve as a custom RequestRouter. Signals:
Ray's own fresh per-replica in-flight count plus the stats each replica records about once a
second (waiting, running, KV usage, recent preemptions)."""

from __future__ import annotations

import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from router.policy import Policy, ReplicaStats, RoutingConfig


class LoadAwareRouter(RequestRouter):
    def initialize_state(self, routing: dict | None = None, **_: object) -> None:
        self.routing_config = RoutingConfig.model_validate(routing or {})
        self.policy = Policy(self.routing_config)

    def _stats_of(self, replica: RunningReplica, now: float) -> ReplicaStats:
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        recorded = replica.routing_stats or {}
        ts = recorded.get("ts")
        return ReplicaStats(
            replica_id=replica.replica_id.unique_id,
            ongoing=int(ongoing or 0),
            waiting=int(recorded.get("waiting", 0)),
            running=int(recorded.get("running", 0)),
            kv_usage=float(recorded.get("kv_usage", 0.0)),
            preemptions_per_s=float(recorded.get("preemptions_per_s", 0.0)),
            max_num_seqs=int(recorded.get("max_num_seqs", 0)),
            stats_age_s=(now - ts) if ts else float("inf"),
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
        stats = [self._stats_of(r, now) for r in candidate_replicas]
        prefix = None
        if pending_request is not None and pending_request.args:
            payload = pending_request.args[0]
            if isinstance(payload, dict):
                prefix = payload.get("prefix_key")
        tiers = self.policy.rank(stats, prefix)
        return [[by_id[rid] for rid in tier if rid in by_id] for tier in tiers if tier]
