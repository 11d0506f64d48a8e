"""Replica scoring for the load-aware router: pure functions over per-replica stats (and the
small state pow2 and round_robin keep), no Ray imports, so it is unit-testable and usable from a
simulator. The router's own tally of its requests in flight lives in router/inflight.py.

The request router hands `Policy.rank` one `ReplicaStats` per replica and gets back ranked
tiers of replica ids (best first), the shape of Ray's `RequestRouter.choose_replicas`.

Score (lower is better), in units of "queued requests":

    fresh    = stats_age_s <= stale_stats_periods * stats_period_s
    engine   = max(0, waiting + running - completed_since_stats)
    queue    = max(ongoing, engine, mine) if fresh else max(ongoing, mine)
    overflow = max(0, queue - max_num_seqs)       (0 when max_num_seqs is unknown)
    size     = request_tokens / mean_tokens       (1 when either is unknown)
    sized    = queue + max(0, size * inflight_tokens / mean_tokens - mine) / 2
    kv       = u / (1 - min(u, 0.99)) with u = kv_usage clamped to [0, 1]
    prefill  = prefill_tokens / max_num_batched_tokens (0 when the budget is unknown)
    cached   = weight_cache_hit * cached_tokens / max_num_batched_tokens
               if score - min(score over the candidates) <= cache_bonus_cap, else 0
    score    = weight_queue * (sized + overflow)
             + weight_prefill * prefill
             + weight_kv_usage * kv * min(1, size)      (fresh stats only)
             + weight_preemptions * preemptions_per_s   (fresh stats only)
             + weight_lora_load * (0 if held else 1)     (requests with a LoRA adapter)

`ongoing` is Ray's own in-flight count, always current; `waiting + running` is the engine's view
as of its last report, which also counts requests other routers sent; requests of ours that
finished since that report (`completed_since_stats`) no longer count. Requests beyond the
batch's seats (overflow) wait for a seat, so they count twice.

A count treats a 16-token chat turn and a 1k-token prompt with a 256-token answer alike, and the
KV report that would tell them apart is up to a few periods old. So this router keeps its own,
always-current tally of its requests on each replica (`InflightLoad`, router/inflight.py): `mine` of them, with a
KV footprint (prompt + max_tokens) of `inflight_tokens`; `mean_tokens` is the average footprint
of its in-flight requests over all replicas, and `size` that of the request being routed
(`request_tokens`) relative to it. Every request takes a seat; `sized` adds the KV contention
between the request being routed and ours already there, beyond one unit per request: nothing
when all requests are alike (the count says it all) or when a short request only needs a
seat, a lot when a long request would meet long requests. For the same reason the KV term is
weighted by the request's size (at most 1): a chat turn barely moves a cache's usage, a
1k-token prompt can tip it into preemptions.

A count does not tell a request still in prefill from one decoding, and for the next request's
first token that is the difference that matters: a replica's scheduler runs its requests' prefill
chunks before admitting a newcomer, so a request that lands beside a 1k-token prompt still in
prefill waits for every remaining chunk, while one that lands beside decodes is scheduled in the
next step. `prefill_tokens` is this router's estimate of the prompt tokens its requests on the
replica have yet to prefill: a request counts its whole prompt until the ingress reports its
first token (`InflightLoad.first_token`), less the tokens the replicas' observed prefill rate
(prompt tokens per second to a first token, learned from those reports) says it has done since
it was routed. Divided by the step's token budget it counts the heavy steps ahead of a newcomer.

`cached_tokens` is how many of the request's prompt tokens the replica holds in its prefix cache,
exact as of its last KV-event batch (router/kv_index.py mirrors every replica's cache): prefill
the request would not have to run there, counted in steps of the replica's token budget like
the prefill already ahead, and weighed (`weight_cache_hit`) against the load in queued requests:
prefill a replica does not run saves its other requests a long step too, while one more request
in a batch with free seats costs them little. The ranking uses score - cached. The cache term
counts only on replicas whose load score is within `cache_bonus_cap` of the least loaded one, so a
hot prefix spills to another replica (which then caches it too) once the replicas holding it are
that much busier, and among the replicas close enough in load the one holding most of the prompt
wins. (A cap on the term itself would not do: it would rank a replica holding a conversation's
shared system prompt level with the one holding its whole history.)

A request for a LoRA adapter runs on any replica, but one that does not hold the adapter loaded
(its LRU of max_cpu_loras) loads it from disk first, which delays the request, and may evict
an adapter that the next request needs. `held` is true where the replica's last report lists
the adapter or this router sent a request for it there since (`InflightLoad.adapter_sent`: the
replica loads it for that request, so the next one sees it held before the next report); when
the stats are stale, the router's tally alone. A holder wins ties and near-ties (it also heads
its own tier, as cache hits do), and an adapter's traffic spills to a replica that does not
hold it once the holders' load scores exceed that replica's by `weight_lora_load` queued
requests: the replica then loads it, and the adapter's holders grow with its load. Pure LRU
caches fill with whatever the last requests asked for; with the term each replica's LRU keeps
a stable set of adapters, and the per-replica loads fall (bench/lora_routing.py).

The KV term is about u at low usage and grows without bound near a full cache (0.5 -> 1,
0.9 -> 9, 0.99 -> 99), where a new request would force preemptions. Stale stats drop to
Ray's count and our own tally rather than steer by numbers that may be seconds old.
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
DEFAULT_TOKEN_BUDGET = 2048  # EngineConfig's max_num_batched_tokens default


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
    weight_prefill: float = Field(
        default=1.0, ge=0, description="per step's token budget of prefill still ahead"
    )
    weight_preemptions: float = Field(default=2.0, ge=0)
    stats_period_s: float = Field(default=1.0, gt=0)
    stale_stats_periods: float = Field(
        default=3.0, gt=0, description="stats older than this many periods are ignored"
    )
    score_tolerance: float = Field(
        default=0.5, ge=0, description="replicas within this score of a tier's best share it"
    )
    kv_events: bool = Field(
        default=True,
        description="route by each replica's actual prefix cache, mirrored from its KV events "
        "(exact; replaces prefix_affinity's guess)",
    )
    weight_cache_hit: float = Field(
        default=16.0, ge=0, description="per step's token budget of prompt found cached"
    )
    cache_bonus_cap: float = Field(
        default=8.0, ge=0, description="the most the cache term may take off a score"
    )
    kv_events_poll_s: float = Field(
        default=0.05, gt=0, description="how often a router fetches new KV events"
    )
    weight_lora_load: float = Field(
        default=2.0,
        ge=0,
        description="in queued requests: what a replica that does not hold the request's LoRA "
        "adapter loaded costs (it loads it first); 0: routing ignores adapters",
    )
    kv_transfer: bool = Field(
        default=True,
        description="fetch a prompt's cached prefix from the replica holding it when that beats "
        "recomputing it (router/kv_transfer.py's cost model); off: recompute",
    )
    kv_transfer_min_blocks: int = Field(
        default=4, ge=1, description="the fewest blocks worth a fetch"
    )
    kv_transfer_margin: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="a fetch (or sending to the holder) must be this fraction faster than the "
        "ranking's choice to replace it",
    )
    kv_prefill_tokens_per_s: float = Field(
        default=2000.0, gt=0, description="prefill rate assumed while a replica reports none"
    )
    kv_transfer_bytes_per_s: float = Field(
        default=1e9, gt=0, description="KV transfer rate assumed while a replica reports none"
    )
    kv_bytes_per_block: int = Field(
        default=737_280,
        gt=0,
        description="one block's KV bytes assumed while a replica reports none (a 16-token "
        "block of a 135M model in fp32)",
    )
    kv_fetch_latency_s: float = Field(
        default=0.005, ge=0, description="fixed cost of one fetch (the calls, the import)"
    )
    max_candidates: int = Field(
        default=0,
        ge=0,
        description="load_aware: rank this many replicas sampled at random per request (the "
        "prefix's preferred replica always among them); 0: every replica",
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
    # this router's own tally (InflightLoad), current at every decision:
    inflight_requests: int = 0  # its requests in flight on the replica with a known size
    inflight_tokens: int = 0  # their prompt + max_tokens, summed
    completed_since_stats: int = 0  # its requests there that finished after the stats were taken
    prefill_tokens: float = 0.0  # prompt tokens of its requests there not yet prefilled (estimate)
    max_num_batched_tokens: int = 0  # the replica's token budget per step; 0: unknown
    cached_tokens: int = 0  # of the request's prompt, found in the replica's prefix cache
    # the request's LoRA adapter (None: it has none): held as of the replica's last report, or
    # sent there by this router since; and in this router's tally of adapters it sent there
    lora_loaded: bool | None = None
    lora_sent: bool = False


def stats_are_fresh(stats: ReplicaStats, cfg: RoutingConfig) -> bool:
    return stats.stats_age_s <= cfg.stale_stats_periods * cfg.stats_period_s


def effective_queue(stats: ReplicaStats, cfg: RoutingConfig) -> int:
    """Requests on the replica: Ray's count, our own tally, or the engine's report when fresh
    and larger (less the requests of ours that finished since it was taken)."""
    known = max(stats.ongoing, stats.inflight_requests)
    if stats_are_fresh(stats, cfg):
        return max(known, stats.waiting + stats.running - stats.completed_since_stats)
    return known


@dataclass(frozen=True)
class RequestSize:
    """The request being routed against this router's in-flight requests: their average KV
    footprint (0: none known) and the request's own relative to it (1: unknown)."""

    mean_tokens: float = 0.0
    relative: float = 1.0

    @classmethod
    def of(cls, replicas: Sequence[ReplicaStats], request_tokens: int = 0) -> RequestSize:
        mean = mean_request_tokens(replicas)
        relative = request_tokens / mean if mean > 0 and request_tokens > 0 else 1.0
        return cls(mean, relative)


def sized_queue(stats: ReplicaStats, cfg: RoutingConfig, size: RequestSize) -> float:
    """`effective_queue` plus the KV contention between the request being routed and this
    router's requests on the replica beyond one unit each (the module docstring's `sized`)."""
    queue = effective_queue(stats, cfg)
    if size.mean_tokens <= 0 or stats.inflight_requests <= 0:
        return float(queue)
    contention = size.relative * stats.inflight_tokens / size.mean_tokens
    return queue + max(0.0, contention - stats.inflight_requests) / 2


def kv_pressure(kv_usage: float) -> float:
    """u / (1 - u), capped near 1: about linear when the cache is roomy, steep when full."""
    usage = min(max(kv_usage, 0.0), _KV_USAGE_CAP)
    return usage / (1.0 - usage)


def mean_request_tokens(replicas: Sequence[ReplicaStats]) -> float:
    """Average size (prompt + max_tokens) of this router's in-flight requests; 0 if none."""
    count = sum(r.inflight_requests for r in replicas)
    return sum(r.inflight_tokens for r in replicas) / count if count else 0.0


def prefill_steps(stats: ReplicaStats) -> float:
    """Steps of the replica's token budget that prefill still ahead fills (0: budget unknown)."""
    if stats.max_num_batched_tokens <= 0:
        return 0.0
    return max(stats.prefill_tokens, 0.0) / stats.max_num_batched_tokens


def score(stats: ReplicaStats, cfg: RoutingConfig, size: RequestSize = RequestSize()) -> float:
    """Load score of one replica for a request of `size`, lower is better; the formula is in
    the module docstring. The default size knows nothing of tokens: counts and reports only."""
    queue = effective_queue(stats, cfg)
    overflow = max(0, queue - stats.max_num_seqs) if stats.max_num_seqs > 0 else 0
    total = cfg.weight_queue * (sized_queue(stats, cfg, size) + overflow)
    total += cfg.weight_prefill * prefill_steps(stats)
    if stats_are_fresh(stats, cfg):
        kv_weight = cfg.weight_kv_usage * min(1.0, size.relative)
        total += kv_weight * kv_pressure(stats.kv_usage)
        total += cfg.weight_preemptions * max(stats.preemptions_per_s, 0.0)
    return total


def holds_lora(stats: ReplicaStats, cfg: RoutingConfig) -> bool | None:
    """Whether the replica holds the request's adapter (None: the request has none): its last
    report plus this router's sends since when the stats are fresh, the router's tally alone
    when they are stale."""
    if stats.lora_loaded is None:
        return None
    return stats.lora_loaded if stats_are_fresh(stats, cfg) else stats.lora_sent


def lora_cost(stats: ReplicaStats, cfg: RoutingConfig) -> float:
    """`weight_lora_load` where the request has an adapter the replica does not hold."""
    return cfg.weight_lora_load if holds_lora(stats, cfg) is False else 0.0


def lora_aware(replicas: Sequence[ReplicaStats], cfg: RoutingConfig) -> bool:
    """Whether adapters count in this ranking: the term is on and the request has one."""
    return cfg.weight_lora_load > 0 and any(r.lora_loaded is not None for r in replicas)


def cache_bonus(stats: ReplicaStats, cfg: RoutingConfig) -> float:
    """The request's cached prompt tokens on the replica in steps of its token budget (the
    default budget when unknown), times `weight_cache_hit`."""
    budget = stats.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET
    return cfg.weight_cache_hit * stats.cached_tokens / budget


def ranking_scores(
    replicas: Sequence[ReplicaStats], cfg: RoutingConfig, size: RequestSize
) -> dict[str, float]:
    """Each replica's `score` plus its adapter load (`lora_cost`), less its cache bonus where
    that sum is within `cache_bonus_cap` of the lowest (the module docstring's `cached`)."""
    plain = {r.replica_id: score(r, cfg, size) + lora_cost(r, cfg) for r in replicas}
    if not any(r.cached_tokens for r in replicas):
        return plain
    window = min(plain.values()) + cfg.cache_bonus_cap
    out = dict(plain)
    for r in replicas:
        if r.cached_tokens > 0 and plain[r.replica_id] <= window:
            out[r.replica_id] -= cache_bonus(r, cfg)
    return out


def decision_reason(
    replicas: Sequence[ReplicaStats], cfg: RoutingConfig, chosen: str, size: RequestSize
) -> str:
    """Why `chosen` won, for the decisions-by-reason metric: "cache" (a cache hit put it ahead
    of the replica load alone would pick), "spill" (another replica holds more of the prompt,
    but load kept the request off it), "lora" (it holds the request's adapter, which put it
    ahead of the replica load alone would pick), "load" (the load score alone, with or without
    hits elsewhere being equal)."""
    by_id = {r.replica_id: r for r in replicas}
    best_hit = max((r.cached_tokens for r in replicas), default=0)
    if best_hit > 0 and by_id[chosen].cached_tokens < best_hit:
        return "spill"
    plain = {rid: score(r, cfg, size) for rid, r in by_id.items()}
    ahead_of_load = plain[chosen] > min(plain.values()) + cfg.score_tolerance
    if by_id[chosen].cached_tokens > 0 and ahead_of_load:
        return "cache"
    if ahead_of_load and lora_aware(replicas, cfg) and holds_lora(by_id[chosen], cfg):
        return "lora"
    return "load"


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


def _load_tiers(
    replicas: Sequence[ReplicaStats], cfg: RoutingConfig, size: RequestSize
) -> list[list[str]]:
    """Replicas sorted by score, grouped into tiers: a tier holds every replica within
    `score_tolerance` of the tier's best that has as much of the prompt cached and, where
    adapters count, the same holding of the request's adapter (the tier's lead is its
    least-loaded replica: a tie on score must not hand the request to a replica that would
    prefill what another has cached, or load an adapter another holds)."""
    ranked = ranking_scores(replicas, cfg, size)
    aware = lora_aware(replicas, cfg)
    scored = sorted(
        (ranked[r.replica_id], -r.cached_tokens, not (aware and holds_lora(r, cfg)), r.replica_id)
        for r in replicas
    )
    tiers: list[list[str]] = []
    tier_best = -math.inf
    tier_kind: tuple[int, bool] = (0, False)
    for value, neg_cached, lacks_lora, replica_id in scored:
        kind = (neg_cached, lacks_lora)
        if not tiers or value > tier_best + cfg.score_tolerance or kind != tier_kind:
            tiers.append([])
            tier_best = value
            tier_kind = kind
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
    size: RequestSize,
) -> list[list[str]]:
    """Put the prefix's rendezvous replica first unless its score exceeds the least-loaded
    replica's by more than `imbalance_threshold`; then keep `tiers` without it. The score (in
    queued requests, sized, KV pressure included) decides rather than the bare count: a replica
    busy with huge requests is no place for a prompt whose only claim is a cached prefix."""
    by_id = {r.replica_id: r for r in replicas}
    preferred = preferred_replica(prefix, list(by_id))
    if preferred is None:
        return tiers
    scores = {r.replica_id: score(r, cfg, size) for r in replicas}
    if scores[preferred] - min(scores.values()) > cfg.imbalance_threshold:
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
    request_tokens: int = 0,
) -> list[list[str]]:
    """Ranked tiers of replica ids, best tier first; the caller may take any replica of a tier.

    load_aware ranks every replica by `score` for a request of `request_tokens` (prompt +
    max_tokens; 0: unknown); pow2 returns its two samples, fewer in-flight first; round_robin
    needs the `round_robin` state (use `Policy`, which keeps it). With cfg.prefix_affinity and
    a prefix key, the prefix's rendezvous replica leads unless the load is imbalanced.
    """
    if not replicas:
        return []
    size = RequestSize.of(replicas, request_tokens)
    if cfg.policy == "load_aware":
        tiers = _load_tiers(replicas, cfg, size)
    elif cfg.policy == "pow2":
        tiers = _pow2_tiers(replicas, rng or random.Random())
    else:
        if round_robin is None:
            raise ValueError("the round_robin policy is stateful: pass round_robin= or use Policy")
        tiers = [[rid] for rid in round_robin.next([r.replica_id for r in replicas])]
    if cfg.prefix_affinity and prefix is not None:
        tiers = _with_prefix_affinity(tiers, replicas, cfg, prefix, size)
    return tiers


def lead_replica(
    tier: Sequence[str], replicas: Sequence[ReplicaStats], cfg: RoutingConfig, rng: random.Random
) -> list[str]:
    """`tier` with the replica a request goes to first: the fewest requests (`effective_queue`),
    ties at random. The router notes that choice (`InflightLoad.chosen`) before Ray routes the
    next request of a burst; left to Ray, the pick among a tier's equals would not be known."""
    by_id = {r.replica_id: r for r in replicas}
    order = list(tier)
    rng.shuffle(order)
    order.sort(key=lambda rid: effective_queue(by_id[rid], cfg) if rid in by_id else 0)
    return order


class Policy:
    """The router's entry point: `rank` dispatches on cfg.policy and keeps the state that
    pow2 (random source) and round_robin (position) need."""

    def __init__(self, cfg: RoutingConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self._rng = rng if rng is not None else random.Random()
        self._round_robin = RoundRobin()

    def rank(
        self,
        replicas: Sequence[ReplicaStats],
        prefix: int | None = None,
        request_tokens: int = 0,
    ) -> list[list[str]]:
        return rank_replicas(
            replicas,
            self.cfg,
            prefix,
            rng=self._rng,
            round_robin=self._round_robin,
            request_tokens=request_tokens,
        )

    def candidates(
        self,
        replica_ids: Sequence[str],
        prefix: int | None = None,
        cached: dict[str, int] | None = None,
        lora_holders: Sequence[str] = (),
    ) -> list[str]:
        """The replicas to rank for one request: pow2's two random ones; for load_aware all of
        them, or `max_candidates` sampled at random, so that a decision costs O(max_candidates)
        stats and scores at fleet scale. A sample always holds the prefix's rendezvous replica
        (prefix affinity), the replicas holding most of the prompt (`cached`: the KV index's
        hits, up to a quarter of the sample) and replicas holding the request's adapter
        (`lora_holders`, up to another quarter, at random; with weight_lora_load > 0)."""
        if self.cfg.policy == "pow2" and len(replica_ids) > 2:
            return self._rng.sample(list(replica_ids), 2)  # all pow2 looks at
        k = self.cfg.max_candidates
        if self.cfg.policy != "load_aware" or k <= 0 or len(replica_ids) <= k:
            return list(replica_ids)
        must: list[str] = []
        if cached:
            holders = sorted(cached, key=lambda rid: (-cached[rid], rid))
            must += holders[: max(1, k // 4)]
        if lora_holders and self.cfg.weight_lora_load > 0:
            taken = set(must)
            free = [rid for rid in lora_holders if rid not in taken]
            must += self._rng.sample(free, min(len(free), max(1, k // 4)))
        if self.cfg.prefix_affinity and prefix is not None:
            preferred = preferred_replica(prefix, replica_ids)
            if preferred is not None and preferred not in must:
                must.append(preferred)
        chosen = set(must)
        sample = must + [r for r in self._rng.sample(list(replica_ids), k) if r not in chosen]
        return sample[:k]

    def prefix_key(self, token_ids: Sequence[int], block_size: int) -> int | None:
        """The prefix key for `rank` per this config; None when prefix affinity is off."""
        if not self.cfg.prefix_affinity:
            return None
        return prefix_key(token_ids, block_size, self.cfg.prefix_affinity_blocks)
