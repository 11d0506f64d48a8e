"""The discrete-event simulation of a stepserve cluster (see sim/__init__.py).

What runs is stepserve's own code for every decision:
- each replica is a `replica.scheduler.Scheduler` (with its KV cache manager: prefix caching,
  chunked prefill, preemption, eviction) stepped back to back; a step's duration is the
  profile's `StepTimeModel` price of the `SchedulerOutput` the scheduler produced;
- each ingress replica has its own `router.policy.Policy` and `router.inflight.InflightLoad`
  tally, and ranks replicas from `router.inflight.replica_stats` over the replicas' last
  `RoutingStats` (built by `RoutingStats.of_scheduler`, as a serving replica builds it), which
  routers see `stats_delivery_s` after each stats period; Ray's part is modelled: its in-flight
  count per replica (exact), `max_ongoing_requests` (requests wait at the router when every
  replica is full), and its pick of the least-loaded replica within the first tier;
- the autoscaler is `cluster.autoscaling.QueueDepthPolicy` (or Ray's default ongoing-requests
  policy) fed per-replica metrics averaged over the look-back window, with Ray's bounds and
  up/down delays, and replicas that take `cold_start_s` to start and drain before they stop.

Time is simulated seconds; nothing sleeps. The same seed gives the same run.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal

from cluster.autoscaling import QueueDepthPolicy
from cluster.config import ClusterConfig
from replica.contracts import AutoscalingStats, PreemptionRate, RoutingStats
from replica.request import Request, RequestRejected, SamplingParams
from replica.scheduler import Scheduler
from router.decision import decide
from router.inflight import InflightLoad
from router.kv_index import KVIndex
from router.policy import Policy
from sim.calibrate import serving_step
from sim.profile import Profile, StepShape
from sim.workloads import Conversation, RequestSpec, oracle_hit_tokens

FILLER_TOKEN = 7  # what a simulated request generates when its spec names no answer tokens
STARTING, RUNNING, DRAINING, STOPPED = "starting", "running", "draining", "stopped"


@dataclass
class SimSettings:
    """What the simulation needs besides the ClusterConfig and the profile."""

    net_latency_s: float = 0.002  # one way, client -> ingress -> replica (and back)
    stats_delivery_s: float = 0.0  # a replica's recorded stats reach the routers this much later
    cold_start_s: float = 10.0  # a new replica's start until it takes requests
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


class SimRequest:
    __slots__ = (
        "rid", "spec", "arrival", "conv", "turn", "ingress", "replica", "routed_at",
        "recv_at", "first_sched_at", "first_token_at", "finished_at", "n_out",
        "preemptions", "cached_tokens", "status", "answer", "prefix_key", "footprint",
        "engine_request", "joins_step", "hashes", "predicted_hit", "reason",
    )  # fmt: skip

    def __init__(self, rid: str, spec: RequestSpec, arrival: float) -> None:
        self.rid = rid
        self.spec = spec
        self.arrival = arrival
        self.conv: Conversation | None = None
        self.turn = 0
        self.ingress: SimIngress | None = None
        self.replica: SimReplica | None = None
        self.routed_at = self.recv_at = math.nan
        self.first_sched_at = self.first_token_at = self.finished_at = math.nan
        self.n_out = 0
        self.preemptions = 0
        self.cached_tokens = 0
        self.status = "pending"  # -> ok | rejected | unfinished
        self.answer: list[int] | None = None  # the tokens the replica generated
        self.prefix_key: int | None = None
        self.footprint = spec.num_prompt_tokens + spec.output_len
        self.engine_request: Request | None = None
        self.joins_step = 0  # the replica step it can first be scheduled in (1-based)
        self.hashes: list[int] | None = None  # the prompt's block hashes (KV-event routing)
        self.predicted_hit = -1  # the router's prediction of hit tokens (-1: none made)
        self.reason = ""  # why the router chose the replica

    def planned_answer(self) -> list[int] | None:
        """The tokens this request is to generate (a conversation turn's), or None."""
        return None if self.conv is None else self.conv.turns[self.turn].answer_ids

    def result(self, net: float) -> dict:
        ttft = self.first_token_at + net - self.arrival
        e2e = self.finished_at + net - self.arrival
        tpot = (e2e - ttft) / (self.n_out - 1) if self.n_out > 1 else math.nan
        return {
            "id": self.rid,
            "kind": self.spec.kind,
            "arrival_s": self.arrival,
            "prompt_tokens": self.spec.num_prompt_tokens,
            "output_tokens": self.n_out,
            "status": self.status,
            "replica": self.replica.rid if self.replica else None,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "e2e_s": e2e,
            "queue_s": self.first_sched_at - self.recv_at,
            "preemptions": self.preemptions,
            "hit_tokens": self.cached_tokens,
            "predicted_hit_tokens": self.predicted_hit,
            "reason": self.reason,
        }


class SimReplica:
    """One replica: the real Scheduler, stepped back to back while it has work."""

    def __init__(self, sim: Simulation, rid: str, created: float) -> None:
        self.sim = sim
        self.rid = rid
        # speculation is not modelled (its gain depends on the text, which the simulator
        # does not have): the replica's scheduler proposes no drafts
        cfg = sim.config.engine.model_copy(update={"num_speculative_tokens": 0})
        self.scheduler = Scheduler(cfg, sim.num_kv_blocks, sim.max_model_len)
        self.events = (
            self.scheduler.kv.pool.enable_events(cfg.block_size)
            if sim.config.routing.kv_events
            else None
        )
        self.state = STARTING
        self.created = created
        self.stopped_at = math.nan
        self.ongoing = 0  # Ray's in-flight count (routed, not yet finished at the router)
        self.busy = False
        self.recorded: deque[RoutingStats] = deque()  # reports in flight to the routers
        self.visible: RoutingStats | None = None
        self.preemptions = PreemptionRate()
        self.requests: dict[str, SimRequest] = {}
        self.busy_s = 0.0
        self.num_steps = 0
        self.metric_window: deque[tuple[float, AutoscalingStats]] = deque()

    # -- requests --------------------------------------------------------------------------
    def receive(self, now: float, req: SimRequest) -> None:
        req.recv_at = now
        params = SamplingParams(max_tokens=req.spec.output_len, temperature=0.0, ignore_eos=True)
        request = Request(req.rid, req.spec.prompt_ids, params, frozenset(), now)
        try:
            self.scheduler.add_request(request)
        except RequestRejected:
            self.sim.finish(req, now, "rejected")
            return
        req.engine_request = request
        req.joins_step = self.num_steps + 1
        self.requests[req.rid] = req
        if not self.busy:
            # the engine loop wakes for it: requests arriving at the same moment join the step
            self.busy = True
            self.sim.at(now, self._start_step)

    def _start_step(self, now: float) -> None:
        so = self.scheduler.schedule()
        if so.is_empty:
            self.busy = False
            return
        self.busy = True
        if self.sim.step_log is not None:
            self.sim.step_log.append(
                (
                    self.rid,
                    [(s.request_id, s.start, s.num_tokens) for s in so.scheduled],
                    list(so.preempted_request_ids),
                )
            )
        for s in so.scheduled:
            req = self.requests[s.request_id]
            if req.first_sched_at != req.first_sched_at:  # nan: first time scheduled
                req.first_sched_at = now
        shape = StepShape.of_scheduler_output(so)
        serving = self.sim.serving
        if serving is None:
            duration = self.sim.model.predict(shape)
        else:
            streamed = sum(1 for s in so.scheduled if s.sample)
            duration = serving_step(serving, self.sim.model, shape, streamed)
        self.busy_s += duration
        self.num_steps += 1
        self.sim.at(now + duration, self._end_step, so)

    def _end_step(self, now: float, so) -> None:
        sampled = {}
        for s in so.scheduled:
            if s.sample:
                req = self.requests[s.request_id]
                answer = req.planned_answer()
                k = s.request.num_output_tokens
                sampled[s.request_id] = answer[k] if answer and k < len(answer) else FILLER_TOKEN
        outputs = self.scheduler.update_from_output(so, sampled)
        sim = self.sim
        if self.events is not None:
            batch = self.events.seal()
            if batch is not None:
                sim.at(now + sim.settings.kv_event_delay_s, sim.deliver_kv_events, (self, batch))
        for out in outputs:
            req = self.requests[out.request_id]
            req.n_out += 1
            if req.n_out == 1:
                sim.first_token(req, now)
            if out.finish_reason is not None:
                request_obj = req.engine_request
                req.preemptions = request_obj.num_preemptions
                req.cached_tokens = max(request_obj.num_cached_tokens, 0)
                if req.conv is not None or sim.oracle:  # the next turn's history holds it
                    req.answer = request_obj.all_token_ids[request_obj.num_prompt_tokens :]
                elif req.hashes is None:
                    req.spec.release()  # a lazily made prompt is not needed any more
                req.engine_request = None
                del self.requests[out.request_id]
                sim.finish(req, now, "ok")
        if self.scheduler.has_unfinished():
            self._start_step(now)
        else:
            self.busy = False
            if self.state == DRAINING:
                sim.maybe_stop(self, now)

    # -- reports ---------------------------------------------------------------------------
    def record_stats(self, now: float) -> RoutingStats:
        kv = self.scheduler.kv
        stats = RoutingStats.of_scheduler(
            self.rid, now, self.scheduler.stats(), self.sim.config.engine, self.preemptions,
            num_kv_blocks=kv.num_blocks, num_free_blocks=kv.pool.num_free_blocks,
        )  # fmt: skip
        delay = self.sim.settings.stats_delivery_s
        if delay <= 0:
            self.visible = stats
        else:
            self.recorded.append(stats)
        return stats

    def stats_for_router(self, now: float) -> RoutingStats | None:
        delay = self.sim.settings.stats_delivery_s
        while self.recorded and self.recorded[0].ts + delay <= now:
            self.visible = self.recorded.popleft()
        return self.visible


class SimIngress:
    """One ingress replica: its own routing policy state and in-flight tally."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim = sim
        self.index = index
        self.policy = Policy(sim.config.routing, random.Random(sim.rng.random()))
        self.load = InflightLoad()
        cfg = sim.config
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
                req.hashes = self.index.prompt_hashes(req.spec.prompt_ids)
            hits = self.index.hit_tokens(req.hashes, by_id)
        decision = decide(
            self.policy, self.load, list(by_id),
            lambda rid: (by_id[rid].ongoing, by_id[rid].stats_for_router(now)),
            now, self.rng, prefix=req.prefix_key, footprint_tokens=req.footprint, hits=hits,
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
        sim.at(now + sim.settings.net_latency_s, chosen.receive, req)
        return True


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
        self.rng = random.Random(self.settings.seed)
        engine = config.engine
        self.num_kv_blocks = engine.num_kv_blocks or profile.capacity["num_kv_blocks"]
        self.max_model_len = engine.max_model_len or profile.capacity["max_model_len"]
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.replicas: list[SimReplica] = []
        self.routable: list[SimReplica] = []
        self._replica_ids = itertools.count()
        self.ingresses = [SimIngress(self, i) for i in range(config.http.ingress_replicas)]
        self.requests: list[SimRequest] = []
        self.replica_count: list[tuple[float, int, int]] = []  # (t, running, target)
        self.timelines: dict[str, list[tuple[float, int, int, float]]] = {}
        self.num_pending = 0
        self._answers: dict[int, list[list[int]]] = {}
        self.step_log: list | None = None  # set to [] to record every step (tests)
        self.oracle = False  # set to report each request's oracle hits (one infinite cache)
        self._req_ids = itertools.count()
        scaling = config.autoscaling
        self.autoscaling = scaling.enabled
        initial = max(scaling.min_replicas, 1) if scaling.enabled else (replicas or config.replicas)
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
        self.requests.append(req)
        return req

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

    def first_token(self, req: SimRequest, now: float) -> None:
        req.first_token_at = now
        req.ingress.load.first_token(req.rid, now + self.settings.net_latency_s)

    def finish(self, req: SimRequest, now: float, status: str) -> None:
        req.finished_at = now
        req.status = status
        net = self.settings.net_latency_s
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
        replica = SimReplica(self, f"replica-{next(self._replica_ids)}", now)
        self.replicas.append(replica)
        self.timelines[replica.rid] = []
        if ready_at <= now:
            self._ready(now, replica)
        else:
            self.at(ready_at, self._ready, replica)
        return replica

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
                self._add_replica(now, ready_at=now + self.settings.cold_start_s)
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


def _oracle(requests: list[SimRequest], block_size: int) -> list[int]:
    rows = [
        (r.arrival, r.spec.prompt_ids, r.finished_at if r.answer else None, r.answer)
        for r in requests
    ]
    return oracle_hit_tokens(rows, block_size)


class SimResult:
    """What a run produced: per-request results, replica timelines and counts."""

    def __init__(self, sim: Simulation, end: float) -> None:
        net = sim.settings.net_latency_s
        self.end_s = end
        self.requests = [r.result(net) for r in sim.requests]
        if sim.oracle:
            for row, hit in zip(self.requests, _oracle(sim.requests, sim.config.engine.block_size)):
                row["oracle_hit_tokens"] = hit
        self.index_stats = [i.index.stats() for i in sim.ingresses if i.index is not None]
        self.replica_count = sim.replica_count
        self.timelines = sim.timelines
        self.replicas = [
            {
                "replica": r.rid,
                "created_s": r.created,
                "stopped_s": r.stopped_at,
                "busy_s": r.busy_s,
                "steps": r.num_steps,
                "preemptions": r.scheduler.num_preemptions_total,
                "prefix_cache_queries": r.scheduler.prefix_cache_queries,
                "prefix_cache_hits": r.scheduler.prefix_cache_hits,
            }
            for r in sim.replicas
        ]
        self.replica_seconds = sum(
            (r.stopped_at if r.stopped_at == r.stopped_at else end) - r.created
            for r in sim.replicas
        )

    def summary(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
        ok = [r for r in self.requests if r["status"] == "ok"]
        out = {
            "requests": len(self.requests),
            "completed": len(ok),
            "rejected": sum(r["status"] == "rejected" for r in self.requests),
            "unfinished": sum(r["status"] == "unfinished" for r in self.requests),
            "duration_s": self.end_s,
            "replica_seconds": self.replica_seconds,
        }
        if not ok:
            return out
        first = min(r["arrival_s"] for r in ok)
        last = max(r["arrival_s"] + r["e2e_s"] for r in ok)
        out_tokens = sum(r["output_tokens"] for r in ok)
        out["output_tokens_per_s"] = out_tokens / (last - first) if last > first else math.nan
        out["requests_per_s"] = len(ok) / (last - first) if last > first else math.nan
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            vals = sorted(r[key] for r in ok if r[key] == r[key])
            out[key] = percentiles(vals)
        prompt = sum(r["prompt_tokens"] for r in ok)
        hits = sum(r["hit_tokens"] for r in ok)
        out["hit_tokens"] = hits
        out["prompt_tokens"] = prompt
        out["prefilled_tokens"] = prompt - hits
        out["hit_rate"] = hits / prompt if prompt else 0.0
        out["preemptions"] = sum(r["preemptions"] for r in ok)
        if ok and "oracle_hit_tokens" in ok[0]:
            out["oracle_hit_tokens"] = sum(r["oracle_hit_tokens"] for r in ok)
        predicted = [r for r in ok if r["predicted_hit_tokens"] >= 0]
        if predicted:
            out["hit_prediction_exact"] = sum(
                r["predicted_hit_tokens"] == r["hit_tokens"] for r in predicted
            ) / len(predicted)
            reasons: dict[str, int] = {}
            for r in predicted:
                reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
            out["decisions_by_reason"] = reasons
        if slo_ttft_s is not None or slo_tpot_s is not None:
            met = sum(
                (slo_ttft_s is None or r["ttft_s"] <= slo_ttft_s)
                and (
                    slo_tpot_s is None
                    or not r["tpot_s"] == r["tpot_s"]
                    or r["tpot_s"] <= slo_tpot_s
                )
                for r in ok
            )
            out["slo_attainment"] = met / len(self.requests)
        return out


def percentiles(sorted_vals: list[float], qs=(50, 90, 99)) -> dict:
    if not sorted_vals:
        return {}
    out = {"mean": sum(sorted_vals) / len(sorted_vals)}
    n = len(sorted_vals)
    for q in qs:
        # linear interpolation between closest ranks (numpy's default)
        pos = (n - 1) * q / 100.0
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out[f"p{q}"] = sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)
    return out


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
) -> SimResult:
    sim = Simulation(config, profile, settings, replicas)
    sim.oracle = oracle
    sim.add_requests(workload.requests)
    sim.add_conversations(workload.conversations)
    return sim.run()
