"""The typed messages that cross a process boundary between the ingress, the request router, the
autoscaler and a replica, each defined once and used on both sides (as vLLM's
EngineCoreRequest, or Ray Serve LLM's typed requests between deployments):

  GenerateRequest   ingress -> (router) -> replica: an EngineRequest (replica/request.py)
                    with routing hints
  Accepted          replica -> ingress: the replica holds a request whose first output is not out
                    yet (so a stream may start: a refusal would have come instead)
  FeedAddress       ingress -> replica, in a streamed GenerateRequest: where the ingress takes its
                    outputs directly (the direct feed: router/feed.py, replica/feed.py)
  Fed               replica -> ingress: the last item of a fed call, how many outputs it wrote
                    to the feed
  RoutingStats      replica -> routers: its load, recorded about once a stats period
  AutoscalingStats  replica -> autoscaling policy: the per-replica metrics Serve aggregates

Ray Serve carries routing and autoscaling stats as dicts (a replica's `record_*_stats` returns
one): `as_dict` builds it on the replica, `from_dict` reads it back on the other side, so the
keys are written in one place.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from replica.request import EngineRequest

if TYPE_CHECKING:
    from replica.config import EngineConfig
    from replica.scheduler import SchedulerStats


class FeedAddress(msgspec.Struct, frozen=True):
    """Where an ingress takes the outputs of its streamed requests directly (its FeedServer,
    router/feed.py): a TCP host and port, and the token a connection presents first."""

    host: str
    port: int
    token: str


@dataclass(frozen=True, slots=True)
class GenerateRequest(EngineRequest):
    """One choice to generate as the ingress sends it: the engine request, plus what the
    router needs to place it, and for a stream where its outputs go."""

    prefix_key: int | None = None  # hash of the prompt's first blocks (prefix affinity), or None
    reports_progress: bool = False  # the sender reports the first token and the end (router tally)
    # a stream's direct feed: the replica writes its outputs there, one frame per step for all
    # of the ingress's requests, and ends the Ray call with Fed (None: every output over Ray)
    feed: FeedAddress | None = None

    @classmethod
    def of(cls, request: EngineRequest, **changes: Any) -> GenerateRequest:
        """`request` with every one of its fields, whatever they are, plus routing hints and
        other `changes` (a fresh request_id per send)."""
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(EngineRequest)}
        return cls(**(fields | changes))


@dataclass(frozen=True, slots=True)
class Accepted:
    """What a replica streams first for a request it took but has not produced output for within
    ACCEPTED_NOTICE_S (queued, compiling its grammar, or a long prefill): the ingress holds a
    stream's HTTP headers until a replica either refuses the request (a real 429 or 503 status)
    or accepts it, or until the fan-out's retries of full replicas are over (STREAM_HOLD_S in
    router/ingress.py), so a refusal comes as an HTTP status rather than an error event inside
    a 200 stream. (Still an error event: a choice of n > 1 refused after another started, or a
    call sent again after its replica was lost.)"""

    request_id: str


@dataclass(frozen=True, slots=True)
class Fed:
    """The last item of a call whose outputs went over its direct feed: `count` outputs were
    written there (the ingress ends the stream once that many arrived). A replica that could
    not reach the feed streams the outputs over Ray instead, and sends no Fed."""

    request_id: str
    count: int


# How long a replica waits for a request's first output before it sends Accepted (twice as long
# for a constrained request): most requests on an idle replica have their first token by then,
# so they cost no extra message.
ACCEPTED_NOTICE_S = 0.5


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """One replica's load as of its engine's last step, for routers (and tests, the soak)."""

    replica_id: str
    ts: float  # wall time the stats were taken (time.time())
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_preemptions_total: int = 0
    preemptions_per_s: float = 0.0  # over the last few seconds
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    num_free_blocks: int = 0
    num_kv_blocks: int = 0
    num_unfinished: int = 0  # requests with an open stream
    num_request_states: int = 0  # requests the engine keeps state for (0 when idle)
    cpu_threads: int = 0  # torch threads of the engine thread (0: not running yet)
    healthy: bool = True  # False: the engine is dead or stalled (routers avoid the replica)
    stalled_s: float = 0.0  # seconds the engine has held requests without finishing a step
    loras: tuple[str, ...] = ()  # names of the LoRA adapters the replica holds loaded (its LRU)
    # the replica's measured costs (at start-up), for the router's fetch-or-recompute choice
    prefill_tokens_per_s: float = 0.0  # prompt tokens a lone prefill computes per second
    kv_transfer_bytes_per_s: float = 0.0  # KV bytes an export + import moves per second
    kv_bytes_per_block: int = 0  # one block's K and V over every layer (this tp rank's share)
    kv_tier_blocks: int = 0  # blocks held in its second tier (host memory, disk)

    @classmethod
    def of_scheduler(
        cls,
        replica_id: str,
        now: float,
        stats: SchedulerStats,
        config: EngineConfig,
        preemptions: PreemptionRate,
        num_kv_blocks: int,
        num_free_blocks: int,
        **extra: Any,
    ) -> RoutingStats:
        """A replica's report from its scheduler's counters (the serving replica and the
        simulator build it here, so both report alike)."""
        return cls(
            replica_id=replica_id,
            ts=now,
            waiting=stats.num_waiting,
            running=stats.num_running,
            kv_usage=stats.kv_usage,
            num_preemptions_total=stats.num_preemptions_total,
            preemptions_per_s=preemptions.update(now, stats.num_preemptions_total),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_free_blocks=num_free_blocks,
            num_kv_blocks=num_kv_blocks,
            loras=tuple(stats.loras),
            **extra,
        )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RoutingStats | None:
        """The stats a replica recorded (None before its first report or for an unknown
        shape: the router then ranks it by Ray's counts alone)."""
        if not data or "replica_id" not in data or "ts" not in data:
            return None
        return cls(**{k: v for k, v in data.items() if k in _ROUTING_FIELDS})

    def age_s(self, now: float) -> float:
        return now - self.ts if self.ts else math.inf


_ROUTING_FIELDS = frozenset(f.name for f in dataclasses.fields(RoutingStats))


class PreemptionRate:
    """Preemptions per second over the last `window_s`, from the running total sampled at each
    report."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, now: float, total: int) -> float:
        samples = self._samples
        samples.append((now, total))
        while len(samples) > 1 and now - samples[0][0] > self.window_s:
            samples.popleft()
        t0, n0 = samples[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0


@dataclass(frozen=True, slots=True)
class AutoscalingStats:
    """The metrics a replica records for the autoscaling policy (cluster/autoscaling.py), which
    Serve averages per replica over the look-back window and hands over by key."""

    QUEUE_DEPTH: ClassVar[str] = "queue_depth"
    WAITING: ClassVar[str] = "waiting"
    KV_USAGE: ClassVar[str] = "kv_usage"
    PREEMPTIONS_PER_S: ClassVar[str] = "preemptions_per_s"

    queue_depth: float  # waiting + running
    waiting: float
    kv_usage: float
    preemptions_per_s: float

    @classmethod
    def of(cls, stats: RoutingStats) -> AutoscalingStats:
        return cls(
            queue_depth=float(stats.waiting + stats.running),
            waiting=float(stats.waiting),
            kv_usage=float(stats.kv_usage),
            preemptions_per_s=float(stats.preemptions_per_s),
        )

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
