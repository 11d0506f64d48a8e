"""The discrete-event simulation of a stepserve cluster (see sim/__init__.py).

What runs is stepserve's own code for every decision:
- each replica is a `replica.scheduler.Scheduler` (with its KV cache manager: prefix caching,
  chunked prefill, preemption, eviction) stepped back to back; a step's duration is the
  profile's `StepTimeModel` price of the `SchedulerOutput` the scheduler produced;
- each ingress replica has its own `router.policy.Policy` and `router.inflight.InflightLoad`
  tally, and decides with the Ray router's `router.decision.decide` over the replicas' last
  `RoutingStats` (built by `RoutingStats.of_scheduler`, as a serving replica builds it), which
  routers see `stats_delivery_s` after each stats period; Ray's part is modelled: its in-flight
  count per replica (exact), `max_ongoing_requests` (requests wait at the router when every
  replica is full), and its pick of the least-loaded replica within the first tier;
- the autoscaler is `cluster.autoscaling.QueueDepthPolicy` (or Ray's default ongoing-requests
  policy) fed per-replica metrics averaged over the look-back window, with Ray's bounds and
  up/down delays, and replicas that take `cold_start_s` to start and drain before they stop.

Time is simulated seconds; nothing sleeps. The same seed gives the same run. This module keeps
the clock, the fleet and the autoscaler; sim/replica.py the replicas, sim/ingress.py the
routers, sim/results.py what a run reports.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal

from cluster.autoscaling import QueueDepthPolicy
from cluster.config import ClusterConfig
from replica.contracts import AutoscalingStats
from replica.request import LoRARequest
from sim.ingress import SimIngress
from sim.profile import Profile, upgrade_serving
from sim.replica import (
    DRAINING,
    RUNNING,
    STARTING,
    STOPPED,
    SimReplica,
    SimRequest,
)
from sim.results import SimResult, percentiles  # noqa: F401  (percentiles: bench/sim_fidelity.py)
from sim.workloads import Conversation, RequestSpec


@dataclass
class SimSettings:
    """What the simulation needs besides the ClusterConfig and the profile."""

    net_latency_s: float = 0.002  # one way, client -> ingress -> replica (and back)
    stats_delivery_s: float = 0.0  # a replica's recorded stats reach the routers this much later
    # a new replica's start until it takes requests; None: the profile's measured start-up
    # (`meta["startup_s"]`), else DEFAULT_COLD_START_S
    cold_start_s: float | None = None
    autoscaler: Literal["stepserve", "ray_default"] = "stepserve"
    ray_target_ongoing_requests: float = 2.0  # Ray's default policy's target per replica
    timeline_period_s: float = 1.0  # how often replica timelines are sampled
    seed: int = 0
    max_sim_time_s: float = math.inf  # stop (unfinished requests are reported) after this
    min_sim_time_s: float = 0.0  # keep the clock (and the autoscaler) running until then
    # KV events (routing.kv_events): a step's batch reaches the routers' indexes this much
    # later (the replica's publish interval plus the router's poll interval, on average)
    kv_event_delay_s: float = 0.05
    # serving calibration (sim/calibrate.py): a step costs Engine.step + extra(tokens it
    # streams); None: the profile's own ("serving"), {}: Engine.step alone
    serving: dict | None = None
    # how long a replica takes to load a LoRA adapter it does not hold; None: the profile's
    # (`Profile.lora_load_s`), else DEFAULT_LORA_LOAD_S
    lora_load_s: float | None = None
    # KV transfer (routing.kv_transfer, PD): a fetch of n blocks takes
    # kv_fetch_latency_s + n * kv_bytes_per_block / kv_transfer_bytes_per_s, and a replica sends
    # one fetch at a time (its egress link is shared: fetches from it queue, first come first
    # served); None: the routing config's fallbacks (RoutingConfig.kv_*), which the replicas
    # also report as their measured rates
    kv_transfer_bytes_per_s: float | None = None
    kv_bytes_per_block: int | None = None
    kv_fetch_latency_s: float | None = None
    # failures: at each of these times the running replica with the most requests is lost (its
    # requests are sent again by their ingress: from the start if no token reached the client,
    # else migrated, resumed from the tokens sent, as router/migration.py does), and Ray starts
    # a replacement that serves after the cold start
    lose_replica_at_s: tuple[float, ...] = ()
    # scale-ups under load: at each of these times one more replica starts (the target grows
    # by one; it takes requests after the cold start)
    add_replica_at_s: tuple[float, ...] = ()
    # network variance: each one-way hop takes net_latency_s plus an exponential draw of this
    # mean (0: every hop exactly net_latency_s)
    net_jitter_s: float = 0.0
    # host variance: each host's steps cost exp(N(0, host_spread)) times their price, drawn once
    # per host from the seed (a host's speed moves a few percent between hours, and near
    # saturation latency moves several times that: docs/simulator-studies.md); None: the
    # profile's serving calibration's `host_spread`, else 0
    host_spread: float | None = None
    # every host's price level times this (1: the profile's); e.g. a live cluster's served
    # steps over their price (`stepserve steps --profile`), to simulate at the level it runs at
    host_level: float = 1.0


DEFAULT_COLD_START_S = 10.0


def host_spread_for(settings: SimSettings, profile: Profile) -> float:
    """The host spread a simulation applies: the settings', else its serving calibration's
    (none when steps are priced as Engine.step alone)."""
    if settings.host_spread is not None:
        return settings.host_spread
    serving = settings.serving if settings.serving is not None else profile.serving
    return float((serving or {}).get("host_spread", 0.0))


# A placeholder until a profile measures it: a rank-16 adapter of the 135M model (q, k, v, o
# and the MLP's projections on 30 layers: about 5 MB of fp32 weights) read from a local disk
# and copied into the replica's adapter slots.
DEFAULT_LORA_LOAD_S = 0.02


class Simulation:
    def __init__(
        self,
        config: ClusterConfig,
        profile: Profile,
        settings: SimSettings | None = None,
        replicas: int | None = None,
    ) -> None:
        self.config = config
        self.profile = profile
        self.model = profile.model
        self.settings = settings or SimSettings()
        self.serving = (
            self.settings.serving if self.settings.serving is not None else profile.serving
        )
        if self.serving is not None and not self.serving:
            self.serving = None  # {}: explicitly Engine.step alone
        self.serving = upgrade_serving(self.serving)  # any layout the profile format had
        self.rng = random.Random(self.settings.seed)
        self.net_rng = random.Random(self.settings.seed + 1)  # apart from routing's draws
        spread = host_spread_for(self.settings, profile)
        if not spread >= 0.0:
            raise ValueError(f"host_spread {spread}: must be >= 0 (0: every host at its price)")
        if not self.settings.host_level > 0.0:
            raise ValueError(f"host_level {self.settings.host_level}: must be > 0 (1: the price)")
        self.host_spread = spread
        self.host_rng = random.Random(self.settings.seed + 2)  # apart from the others' draws
        self.host_speeds: list[float] = []  # per host, in the order hosts are first used
        cold = self.settings.cold_start_s
        if cold is None:
            cold = profile.meta.get("startup_s", DEFAULT_COLD_START_S)
        self.cold_start_s = float(cold)
        load_s = self.settings.lora_load_s
        if load_s is None:
            load_s = profile.lora_load_s
        self.lora_load_s = DEFAULT_LORA_LOAD_S if load_s is None else load_s
        self._loras: dict[str, LoRARequest] = {}
        engine = config.engine
        self.num_kv_blocks = engine.num_kv_blocks or profile.capacity["num_kv_blocks"]
        self.max_model_len = engine.max_model_len or profile.capacity["max_model_len"]
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.replicas: list[SimReplica] = []
        self.hosts: dict[int, list[SimReplica]] = {}  # host -> its replicas (serving calibration)
        self.by_rid: dict[str, SimReplica] = {}
        self.routable: list[SimReplica] = []
        self._replica_ids = itertools.count()
        routing = config.routing
        self.transfer_bytes_per_s = (
            self.settings.kv_transfer_bytes_per_s or routing.kv_transfer_bytes_per_s
        )
        self.bytes_per_block = self.settings.kv_bytes_per_block or routing.kv_bytes_per_block
        latency = self.settings.kv_fetch_latency_s
        self.fetch_latency_s = routing.kv_fetch_latency_s if latency is None else latency
        self.prefill_tokens_per_s = prefill_rate(profile, config.engine.max_num_batched_tokens)
        # PD disaggregation (config.pd): the first prefill_replicas replicas take prompts, the
        # rest continue them (decode)
        self.pd = config.pd
        self.ingresses = [SimIngress(self, i) for i in range(config.http.ingress_replicas)]
        self.requests: list[SimRequest] = []
        self.replica_count: list[tuple[float, int, int]] = []  # (t, running, target)
        self.timelines: dict[str, list[tuple[float, int, int, float]]] = {}
        self.num_pending = 0
        self._answers: dict[int, list[list[int]]] = {}
        self.step_log: list | None = None  # set to [] to record every step (tests)
        self.step_trace: list | None = None  # set to [] for the engine's step-trace lines
        self.oracle = False  # set to report each request's oracle hits (one infinite cache)
        self._req_ids = itertools.count()
        scaling = config.autoscaling
        self.autoscaling = scaling.enabled
        initial = max(scaling.min_replicas, 1) if scaling.enabled else (replicas or config.replicas)
        if self.pd is not None:
            initial = self.pd.prefill_replicas + self.pd.decode_replicas
        self.target = initial
        for _ in range(initial):
            self._add_replica(0.0, ready_at=0.0)
        self._policy_state: dict = {}
        self._decision: tuple[int, float] | None = None  # (direction, since) of Ray's delay logic
        self._policy = QueueDepthPolicy(scaling.model_dump()) if scaling.enabled else None

    # -- the event loop --------------------------------------------------------------------
    def at(self, t: float, fn, arg=None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, arg))

    def run(self) -> SimResult:
        period = self.config.routing.stats_period_s
        offsets = self.rng.random()
        self.at(offsets * period, self._stats_tick)
        self.at(0.0, self._timeline_tick)
        if self.autoscaling:
            self.at(self.config.autoscaling.metrics_interval_s, self._autoscale_tick)
        if self.settings.lose_replica_at_s and self.pd is not None:
            raise ValueError("replica losses are not simulated with PD disaggregation")
        for t in self.settings.lose_replica_at_s:
            self.at(t, self._lose_replica)
        for t in self.settings.add_replica_at_s:
            self.at(t, self._scale_up_one)
        events = self._events
        limit = self.settings.max_sim_time_s
        while events:
            t, _, fn, arg = heapq.heappop(events)
            if t > limit:
                break
            self.now = t
            if arg is None:
                fn(t)
            else:
                fn(t, arg)
            if self._open_work == 0 and t >= self.settings.min_sim_time_s:
                break
        for req in self.requests:
            if req.status == "pending":
                req.status = "unfinished"
        end = self.now
        for r in self.replicas:
            if r.stopped_at != r.stopped_at:
                r.stopped_at = end
        return SimResult(self, end)

    _open_work = 0  # requests and conversations not yet over
    lost_replicas = 0

    # -- workload --------------------------------------------------------------------------
    def add_requests(self, items: list[tuple[float, RequestSpec]]) -> None:
        for t, spec in items:
            self._open_work += 1
            self.at(t, self._arrive, self._new_request(spec, t))

    def add_conversations(self, conversations: list[Conversation]) -> None:
        for conv in conversations:
            self._open_work += 1
            req = self._new_request(conv.spec(0), conv.start_s)
            req.conv, req.turn = conv, 0
            self.at(conv.start_s, self._arrive, req)

    def _new_request(self, spec: RequestSpec, t: float) -> SimRequest:
        req = SimRequest(f"r{next(self._req_ids)}", spec, t)
        name = getattr(spec, "lora", None)
        if name is not None:
            req.lora = self._lora(name)
        self.requests.append(req)
        return req

    def _lora(self, name: str) -> LoRARequest:
        """The adapter named `name` (one object per name: its path is made up)."""
        lora = self._loras.get(name)
        if lora is None:
            if not self.config.engine.lora_enabled:
                raise ValueError(
                    f"the workload asks for LoRA adapter {name!r}, but engine.enable_lora is off"
                )
            lora = self._loras[name] = LoRARequest(name, f"sim://adapters/{name}")
        return lora

    def _arrive(self, now: float, req: SimRequest) -> None:
        ingress = self.ingresses[self.rng.randrange(len(self.ingresses))]
        req.ingress = ingress
        req.prefix_key = ingress.policy.prefix_key(
            req.spec.prompt_ids, self.config.engine.block_size
        )
        if self.num_pending >= self.config.http.max_pending_requests:
            self.finish(req, now, "rejected")
            return
        if ingress.pending or not ingress.route(req, now):
            ingress.pending.append(req)
            self.num_pending += 1

    def _retry_pending(self, now: float) -> None:
        for ingress in self.ingresses:
            while ingress.pending and ingress.route(ingress.pending[0], now):
                ingress.pending.popleft()
                self.num_pending -= 1

    def hop(self) -> float:
        """One one-way trip's latency (client or router <-> replica)."""
        jitter = self.settings.net_jitter_s
        net = self.settings.net_latency_s
        return net + self.net_rng.expovariate(1.0 / jitter) if jitter > 0 else net

    def first_token(self, req: SimRequest, now: float) -> None:
        req.first_token_at = now
        req.back_first = self.hop()
        req.ingress.load.first_token(req.rid, now + req.back_first)

    def handed_off(self, req: SimRequest, now: float) -> None:
        """PD: `req`'s prompt ran on a prefill replica (its first token is out): the prefill
        replica lets it go (at the router a network hop later) and a decode replica continues
        it, fetching the prompt's KV from the prefill replica (sim/ingress.py)."""
        prefill = req.replica
        self.at(now + self.hop(), self._handoff_at_router, (req, prefill))

    def _handoff_at_router(self, now: float, item) -> None:
        req, prefill = item
        prefill.ongoing -= 1
        req.ingress.load.finished(req.rid, now)
        req.ingress.route_decode(req, prefill, now)

    def finish(self, req: SimRequest, now: float, status: str) -> None:
        req.finished_at = now
        req.status = status
        net = req.back_last = self.hop()
        if req.replica is not None:
            self.at(now + net, self._finished_at_router, req)
        else:
            self._finished_at_router(now + net, req)

    def _finished_at_router(self, now: float, req: SimRequest) -> None:
        if req.replica is not None:
            req.replica.ongoing -= 1
            req.ingress.load.finished(req.rid, now)
            if req.replica.state == DRAINING:
                self.maybe_stop(req.replica, now)
        conv = req.conv
        if conv is not None and req.status == "ok" and req.turn + 1 < len(conv.turns):
            # the next turn's history: each earlier turn's actual answer (the tokens generated)
            answers = self._answers.setdefault(conv.conversation_id, [])
            answers.append(req.answer or [])
            arrival = now + conv.turns[req.turn].think_s
            nxt = self._new_request(conv.spec(req.turn + 1, answers), arrival)
            nxt.conv, nxt.turn = conv, req.turn + 1
            self.at(nxt.arrival, self._arrive, nxt)
        else:
            self._open_work -= 1
        if self.num_pending:
            self._retry_pending(now)

    # -- replicas --------------------------------------------------------------------------
    def _add_replica(self, now: float, ready_at: float) -> SimReplica:
        number = next(self._replica_ids)
        replica = SimReplica(self, f"replica-{number}", now)
        if self.pd is not None:
            replica.role = "prefill" if number < self.pd.prefill_replicas else "decode"
        self.replicas.append(replica)
        size = 1
        if self.serving is not None:  # replicas share hosts of the calibration's size
            size = max(1, int(self.serving.get("replicas", 1)))
            replica.host = self.hosts.setdefault(number // size, [])
            replica.host.append(replica)
        replica.speed = self.host_speed(number // size)
        self.by_rid[replica.rid] = replica
        self.timelines[replica.rid] = []
        if ready_at <= now:
            self._ready(now, replica)
        else:
            self.at(ready_at, self._ready, replica)
        return replica

    def host_speed(self, host: int) -> float:
        """The price factor of host number `host` (host_level without a host spread)."""
        while len(self.host_speeds) <= host:
            draw = self.host_rng.gauss(0.0, 1.0) if self.host_spread else 0.0
            self.host_speeds.append(self.settings.host_level * math.exp(self.host_spread * draw))
        return self.host_speeds[host]

    def _ready(self, now: float, replica: SimReplica) -> None:
        if replica.state != STARTING:
            return
        replica.state = RUNNING
        self.routable = [r for r in self.replicas if r.state == RUNNING]
        for ingress in self.ingresses:
            ingress.load.forget_missing([r.rid for r in self.routable])
        if self.num_pending:
            self._retry_pending(now)

    def maybe_stop(self, replica: SimReplica, now: float) -> None:
        if replica.ongoing == 0 and not replica.scheduler.has_unfinished():
            replica.state = STOPPED
            replica.stopped_at = now
            for ingress in self.ingresses:  # a replica that is gone leaves the indexes
                if ingress.index is not None:
                    ingress.index.remove_replica(replica.rid)

    def _scale_up_one(self, now: float) -> None:
        self.target += 1
        self._add_replica(now, ready_at=now + self.cold_start_s)

    def _lose_replica(self, now: float) -> None:
        """The running replica with the most requests dies: it stops at once (what it was
        doing is gone), its requests go back to their ingress a hop later to be sent again,
        and Ray starts a replacement."""
        live = [r for r in self.replicas if r.state in (RUNNING, DRAINING)]
        if not live:
            return
        victim = max(live, key=lambda r: (r.ongoing, -r.created))
        victim.state = STOPPED
        victim.lost = True
        victim.stopped_at = now
        self.lost_replicas += 1
        self.routable = [r for r in self.replicas if r.state == RUNNING]
        for ingress in self.ingresses:
            if ingress.index is not None:
                ingress.index.remove_replica(victim.rid)
        for req in self.requests:
            if req.replica is victim and req.status == "pending":
                victim.abandon(req)
                victim.ongoing -= 1
                self.at(now + self.hop(), self._resend, req)
        replacement = self._add_replica(now, ready_at=now + self.cold_start_s)
        replacement.role = victim.role

    def _resend(self, now: float, req: SimRequest) -> None:
        """A lost replica's request, back at its ingress: routed again (or queued there)."""
        req.ingress.load.finished(req.rid, now)
        req.ingress.load.forget_missing([r.rid for r in self.routable])
        req.replica = None
        req.migrations += 1
        if req.ingress.pending or not req.ingress.route(req, now):
            req.ingress.pending.append(req)
            self.num_pending += 1

    def deliver_kv_events(self, now: float, item) -> None:
        replica, batch = item
        if replica.state == STOPPED:
            return
        for ingress in self.ingresses:
            if ingress.index is not None and not ingress.index.apply(replica.rid, batch):
                # a gap (cannot happen here: delivery is in order): resync from a snapshot
                ingress.index.load_snapshot(replica.rid, replica.events.snapshot())

    # -- periodic work ---------------------------------------------------------------------
    def _stats_tick(self, now: float) -> None:
        for r in self.routable:
            r.record_stats(now)
        self.at(now + self.config.routing.stats_period_s, self._stats_tick)

    def _timeline_tick(self, now: float) -> None:
        running = 0
        for r in self.replicas:
            if r.state in (RUNNING, DRAINING):
                running += 1
                s = r.scheduler
                self.timelines[r.rid].append(
                    (round(now, 3), len(s.running), len(s.waiting), round(s.kv.usage(), 4))
                )
        self.replica_count.append((round(now, 3), running, self.target))
        self.at(now + self.settings.timeline_period_s, self._timeline_tick)

    def _autoscale_tick(self, now: float) -> None:
        cfg = self.config.autoscaling
        look_back = cfg.look_back_period_s
        aggregated: dict[str, dict[str, float]] = {
            k: {} for k in (AutoscalingStats.QUEUE_DEPTH, AutoscalingStats.WAITING,
                            AutoscalingStats.KV_USAGE, AutoscalingStats.PREEMPTIONS_PER_S)
        }  # fmt: skip
        total_ongoing = self.num_pending
        for r in self.routable:
            s = r.scheduler.stats()
            window = r.metric_window
            window.append((now, AutoscalingStats(
                queue_depth=float(s.num_running + s.num_waiting), waiting=float(s.num_waiting),
                kv_usage=s.kv_usage, preemptions_per_s=r.preemptions.update(now, s.num_preemptions_total),
            )))  # fmt: skip
            while window and now - window[0][0] > look_back:
                window.popleft()
            n = len(window)
            for key in aggregated:
                aggregated[key][r.rid] = sum(getattr(m, key) for _, m in window) / n
            total_ongoing += r.ongoing
        current = len(self.routable)
        if self.settings.autoscaler == "stepserve":
            ctx = SimpleNamespace(
                aggregated_metrics=aggregated, total_num_requests=total_ongoing,
                current_num_replicas=current, target_num_replicas=self.target,
                policy_state=self._policy_state,
            )  # fmt: skip
            desired, self._policy_state = self._policy(ctx)
        else:
            target = self.settings.ray_target_ongoing_requests
            desired = math.ceil(total_ongoing / target) if current else self.target
        desired = max(cfg.min_replicas, min(cfg.max_replicas, int(math.ceil(desired))))
        self._apply(desired, now)
        self.at(now + cfg.metrics_interval_s, self._autoscale_tick)

    def _apply(self, desired: int, now: float) -> None:
        """Ray's delay logic: a change happens once it has been wanted, in the same direction,
        for upscale_delay_s (downscale_delay_s)."""
        cfg = self.config.autoscaling
        direction = (desired > self.target) - (desired < self.target)
        if direction == 0:
            self._decision = None
            return
        if self._decision is None or self._decision[0] != direction:
            self._decision = (direction, now)
        delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
        if now - self._decision[1] + 1e-6 < delay:
            return
        self._decision = None
        if direction > 0:
            for _ in range(desired - self.target):
                self._add_replica(now, ready_at=now + self.cold_start_s)
        else:
            live = [r for r in self.replicas if r.state in (STARTING, RUNNING)]
            # Ray stops replicas still starting first, then the newest
            live.sort(key=lambda r: (r.state != STARTING, -r.created))
            for r in live[: self.target - desired]:
                if r.state == STARTING:
                    r.state = STOPPED
                    r.stopped_at = now
                else:
                    r.state = DRAINING
                    self.maybe_stop(r, now)
            self.routable = [r for r in self.replicas if r.state == RUNNING]
        self.target = desired


def prefill_rate(profile: Profile, budget: int) -> float:
    """Prompt tokens per second of a lone prefill in steps of `budget` tokens, as the profile
    prices it (what a replica measures at start-up: RoutingStats.prefill_tokens_per_s)."""
    from sim.profile import StepShape

    shape = StepShape.of([(budget, 0)], [])
    seconds = profile.model.predict(shape)
    return budget / seconds if seconds > 0 else 0.0


@dataclass
class Workload:
    """Open-loop requests (arrival time, spec) and closed-loop conversations."""

    requests: list[tuple[float, RequestSpec]] = field(default_factory=list)
    conversations: list[Conversation] = field(default_factory=list)


def simulate(
    config: ClusterConfig,
    profile: Profile,
    workload: Workload,
    settings: SimSettings | None = None,
    replicas: int | None = None,
    oracle: bool = False,
    step_trace: list | None = None,
) -> SimResult:
    """Run the workload; `step_trace`: a list that gets a line per step, as a real engine core
    writes them under STEPSERVE_STEP_TRACE (sim/steptrace.py reads both)."""
    sim = Simulation(config, profile, settings, replicas)
    sim.oracle = oracle
    sim.step_trace = step_trace
    sim.add_requests(workload.requests)
    sim.add_conversations(workload.conversations)
    return sim.run()
