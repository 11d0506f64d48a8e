"""Replica scoring for the load-aware router: pure functions over per-replica stats, no Ray
imports, so it is unit-testable and usable from a simulator.

The request router hands `Policy.rank` one `ReplicaStats` per replica and gets back ranked
tiers of replica ids (best first), the shape of Ray's `RequestRouter.choose_replicas`.

Score (lower is better), in units of "queued requests":

    fresh    = stats_age_s <= stale_stats_periods * stats_period_s
    queue    = max(ongoing, waiting + running) if fresh else ongoing
    overflow = max(0, queue - max_num_seqs)       (0 when max_num_seqs is unknown)
    kv       = u / (1 - min(u, 0.99)) with u = kv_usage clamped to [0, 1]
    score    = weight_queue * (queue + overflow)
             + weight_kv_usage * kv                 (fresh stats only)
             + weight_preemptions * preemptions_per_s   (fresh stats only)

`ongoing` is Ray's own in-flight count, always current; `waiting + running` is the engine's view
as of its last report, which also counts requests other routers sent. Requests beyond the
batch's seats (overflow) wait for a seat, so they count twice. The KV term is about u at low
usage and grows without bound near a full cache (0.5 -> 1, 0.9 -> 9, 0.99 -> 99), where a new
request would force preemptions. Stale stats drop to `ongoing` alone rather than steer by
numbers that may be seconds old.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_KV_USAGE_CAP = 0.99  # keeps the KV term finite at a full cache


class RoutingConfig(BaseModel):
    """How the ingress picks a replica."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["load_aware", "pow2", "round_robin"] = "load_aware"
    prefix_affinity: bool = False
    prefix_affinity_blocks: int = Field(default=4, ge=1, description="prompt blocks hashed")
    imbalance_threshold: float = Field(
        default=4.0, ge=0, description="queue-length gap at which prefix affinity yields to load"
    )
    weight_queue: float = Field(default=1.0, ge=0)
    weight_kv_usage: float = Field(default=4.0, ge=0)
    weight_preemptions: float = Field(default=2.0, ge=0)
    stats_period_s: float = Field(default=1.0, gt=0)
    stale_stats_periods: float = Field(
        default=3.0, gt=0, description="stats older than this many periods are ignored"
    )
    score_tolerance: float = Field(
        default=0.5, ge=0, description="replicas within this score of a tier's best share it"
    )


@dataclass
class ReplicaStats:
    """What the router knows about one replica."""

    replica_id: str
    ongoing: int  # Ray's fresh in-flight count for this replica
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    preemptions_per_s: float = 0.0  # recent rate
    max_num_seqs: int = 0  # 0: unknown
    stats_age_s: float = math.inf  # seconds since the replica last recorded stats


def stats_are_fresh(stats: ReplicaStats, cfg: RoutingConfig) -> bool:
    return stats.stats_age_s <= cfg.stale_stats_periods * cfg.stats_period_s


def effective_queue(stats: ReplicaStats, cfg: RoutingConfig) -> int:
    """Requests on the replica: Ray's count, or the engine's when fresh and larger."""
    if stats_are_fresh(stats, cfg):
        return max(stats.ongoing, stats.waiting + stats.running)
    return stats.ongoing


def kv_pressure(kv_usage: float) -> float:
    """u / (1 - u), capped near 1: about linear when the cache is roomy, steep when full."""
    usage = min(max(kv_usage, 0.0), _KV_USAGE_CAP)
    return usage / (1.0 - usage)


def score(stats: ReplicaStats, cfg: RoutingConfig) -> float:
    """Load score of one replica, lower is better; the formula is in the module docstring."""
    queue = effective_queue(stats, cfg)
    overflow = max(0, queue - stats.max_num_seqs) if stats.max_num_seqs > 0 else 0
    total = cfg.weight_queue * (queue + overflow)
    if stats_are_fresh(stats, cfg):
        total += cfg.weight_kv_usage * kv_pressure(stats.kv_usage)
        total += cfg.weight_preemptions * max(stats.preemptions_per_s, 0.0)
    return total


def prefix_key(token_ids: Sequence[int], block_size: int, num_blocks: int) -> int | None:
    """A stable 64-bit hash of the prompt's first `num_blocks` full blocks (None when the prompt
    has no full block). Stable across processes, unlike Python's salted `hash`, so every
    ingress replica maps a prefix to the same serving replica."""
    num_full = min(len(token_ids) // block_size, num_blocks) if block_size > 0 else 0
    if num_full <= 0:
        return None
    tokens = token_ids[: num_full * block_size]
    digest = hashlib.blake2b(struct.pack(f"<{len(tokens)}Q", *tokens), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _rendezvous_weight(prefix: int, replica_id: str) -> int:
    data = prefix.to_bytes(8, "little") + replica_id.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def preferred_replica(prefix: int, replica_ids: Sequence[str]) -> str | None:
    """Rendezvous (highest-random-weight) hashing: the replica whose hash with `prefix` is
    largest. Removing a replica only remaps the prefixes it held; adding one takes ~1/n."""
    if not replica_ids:
        return None
    return max(replica_ids, key=lambda rid: (_rendezvous_weight(prefix, rid), rid))


def _load_tiers(replicas: Sequence[ReplicaStats], cfg: RoutingConfig) -> list[list[str]]:
    """Replicas sorted by score, grouped into tiers: a tier holds every replica within
    `score_tolerance` of the tier's best."""
    scored = sorted((score(r, cfg), r.replica_id) for r in replicas)
    tiers: list[list[str]] = []
    tier_best = -math.inf
    for value, replica_id in scored:
        if not tiers or value > tier_best + cfg.score_tolerance:
            tiers.append([])
            tier_best = value
        tiers[-1].append(replica_id)
    return tiers


def _pow2_tiers(replicas: Sequence[ReplicaStats], rng: random.Random) -> list[list[str]]:
    """Two random replicas, the one with fewer in-flight requests first (ties: sample order)."""
    if len(replicas) <= 2:
        sample = list(replicas)
        rng.shuffle(sample)
    else:
        sample = rng.sample(list(replicas), 2)
    sample.sort(key=lambda r: r.ongoing)  # stable: equal counts keep the random order
    return [[r.replica_id] for r in sample]


class RoundRobin:
    """Cycles through replicas in id order; survives replicas joining and leaving."""

    def __init__(self) -> None:
        self._count = 0

    def next(self, replica_ids: Sequence[str]) -> list[str]:
        """All ids rotated so that this turn's pick comes first."""
        ordered = sorted(set(replica_ids))
        if not ordered:
            return []
        start = self._count % len(ordered)
        self._count += 1
        return ordered[start:] + ordered[:start]


def _with_prefix_affinity(
    tiers: list[list[str]],
    replicas: Sequence[ReplicaStats],
    cfg: RoutingConfig,
    prefix: int,
) -> list[list[str]]:
    """Put the prefix's rendezvous replica first unless its queue exceeds the least-loaded
    replica's by more than `imbalance_threshold`; then keep `tiers` without it."""
    by_id = {r.replica_id: r for r in replicas}
    preferred = preferred_replica(prefix, list(by_id))
    if preferred is None:
        return tiers
    least_queue = min(effective_queue(r, cfg) for r in replicas)
    if effective_queue(by_id[preferred], cfg) - least_queue > cfg.imbalance_threshold:
        return tiers
    rest = [[rid for rid in tier if rid != preferred] for tier in tiers]
    return [[preferred]] + [tier for tier in rest if tier]


def rank_replicas(
    replicas: Sequence[ReplicaStats],
    cfg: RoutingConfig,
    prefix: int | None = None,
    *,
    rng: random.Random | None = None,
    round_robin: RoundRobin | None = None,
) -> list[list[str]]:
    """Ranked tiers of replica ids, best tier first; the caller may take any replica of a tier.

    load_aware ranks every replica by `score`; pow2 returns its two samples, fewer in-flight
    first; round_robin needs the `round_robin` state (use `Policy`, which keeps it). With
    cfg.prefix_affinity and a prefix key, the prefix's rendezvous replica leads unless the load
    is imbalanced.
    """
    if not replicas:
        return []
    if cfg.policy == "load_aware":
        tiers = _load_tiers(replicas, cfg)
    elif cfg.policy == "pow2":
        tiers = _pow2_tiers(replicas, rng or random.Random())
    else:
        if round_robin is None:
            raise ValueError("the round_robin policy is stateful: pass round_robin= or use Policy")
        tiers = [[rid] for rid in round_robin.next([r.replica_id for r in replicas])]
    if cfg.prefix_affinity and prefix is not None:
        tiers = _with_prefix_affinity(tiers, replicas, cfg, prefix)
    return tiers


class Policy:
    """The router's entry point: `rank` dispatches on cfg.policy and keeps the state that
    pow2 (random source) and round_robin (position) need."""

    def __init__(self, cfg: RoutingConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self._rng = rng if rng is not None else random.Random()
        self._round_robin = RoundRobin()

    def rank(self, replicas: Sequence[ReplicaStats], prefix: int | None = None) -> list[list[str]]:
        return rank_replicas(
            replicas, self.cfg, prefix, rng=self._rng, round_robin=self._round_robin
        )

    def prefix_key(self, token_ids: Sequence[int], block_size: int) -> int | None:
        """The prefix key for `rank` per this config; None when prefix affinity is off."""
        if not self.cfg.prefix_affinity:
            return None
        return prefix_key(token_ids, block_size, self.cfg.prefix_affinity_blocks)
