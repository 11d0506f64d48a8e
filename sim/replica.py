"""A simulated request and a simulated replica: the replica is the real
`replica.scheduler.Scheduler` (with its KV cache manager), stepped back to back while it has work;
a step lasts what the profile's step-time model prices its `SchedulerOutput` at. It reports
`RoutingStats` as a serving replica does, and its KV events when routing.kv_events is on.

LoRA adapters: a replica holds an LRU of `lora_capacity` adapters (EngineConfig.max_cpu_loras)
and reports their names in its RoutingStats. A request for an adapter it does not hold waits
`lora_load_s` (SimSettings) for the load before it reaches the scheduler (requests for an
adapter already loading wait for the same load); the load evicts the least recently used
adapter that no request on the replica is using (the least recently used one if all are: the
sim does not charge its requests a reload). The request carries its adapter into the
scheduler (EngineRequest.lora), so its KV blocks hash from the adapter's root.

KV transfer: a request routed with a fetch (`SimRequest.fetch`, the decision's KVFetch) first
waits for the blocks to come from their holder: the leading blocks of its prompt the holder
still holds that this replica does not, priced by the Simulation's transfer model (a fixed
latency plus bytes over the rate; one fetch at a time out of each holder: `link_free_at`); they
are then cached here (free, evictable, as blocks a finished request left), so the scheduler's
prefix lookup finds them and the request prefills only the rest. A holder that stopped meanwhile
sends nothing (the request recomputes).

PD (config.pd): a prefill replica runs a request's prompt for its first token (max_tokens 1),
then hands it off (`Simulation.handed_off`); the decode replica runs it as a resumed request
(EngineRequest.resume with that token), its prompt's KV fetched from the prefill replica."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque

from replica.contracts import AutoscalingStats, PreemptionRate, RoutingStats
from replica.request import (
    EngineRequest,
    KVFetch,
    LoRARequest,
    Request,
    RequestRejected,
    Resume,
    SamplingParams,
    extend_block_hashes,
    root_block_hash,
)
from replica.scheduler import Scheduler
from sim.calibrate import path_extra, serving_step
from sim.profile import StepShape
from sim.workloads import Conversation, RequestSpec

FILLER_TOKEN = 7  # what a simulated request generates when its spec names no answer tokens
STARTING, RUNNING, DRAINING, STOPPED = "starting", "running", "draining", "stopped"
STREAM_RATE_TAU_S = 1.0  # the time constant of a replica's streaming-rate average


class SimRequest:
    __slots__ = (
        "rid", "spec", "arrival", "conv", "turn", "ingress", "replica", "routed_at",
        "recv_at", "first_sched_at", "first_token_at", "finished_at", "n_out",
        "preemptions", "cached_tokens", "status", "answer", "prefix_key", "footprint",
        "engine_request", "joins_step", "hashes", "predicted_hit", "reason", "lora",
        "lora_waited", "fetch", "fetched_tokens", "fetch_s", "phase", "prefilled", "first_id",
        "path_first", "path_last", "back_first", "back_last", "migrations", "resume_ids",
    )  # fmt: skip

    def __init__(self, rid: str, spec: RequestSpec, arrival: float) -> None:
        self.rid = rid
        self.spec = spec
        self.arrival = arrival
        self.conv: Conversation | None = None
        self.turn = 0
        self.ingress = None  # the SimIngress (sim/ingress.py) it arrived at
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
        self.lora: LoRARequest | None = None  # its adapter (set by the Simulation from the spec)
        self.lora_waited = False  # it waited for its replica to load its adapter
        self.fetch: KVFetch | None = None  # prefix blocks to bring from their holder first
        self.fetched_tokens = 0  # prompt tokens that came by fetch (all its sends)
        self.fetch_s = 0.0  # time it waited for fetches
        self.phase: str | None = None  # PD: "prefill", then "decode"; None: colocated
        self.prefilled = 0  # tokens its replicas computed by prefill (all phases)
        self.first_id: int | None = None  # PD: the first token, which the decode phase resumes
        # one-way path beyond the idle one (the serving calibration's path_rate_s x the host's
        # streaming rate) when its first token and its last came out
        self.path_first = self.path_last = 0.0
        # the return trip of its first token and of its end (Simulation.hop; nan: not yet)
        self.back_first = self.back_last = math.nan
        self.migrations = 0  # times it was sent again after its replica was lost
        self.resume_ids: list[int] | None = None  # a migration: the tokens the client has

    def planned_answer(self) -> list[int] | None:
        """The tokens this request is to generate (a conversation turn's), or None."""
        return None if self.conv is None else self.conv.turns[self.turn].answer_ids

    def result(self, net: float) -> dict:
        # the return trips (idle path + jitter), plus the load-dependent path both ways: in and
        # out at the first token's load for TTFT; in at it and out at the last one's for e2e
        first = self.back_first if self.back_first == self.back_first else net
        last = self.back_last if self.back_last == self.back_last else net
        ttft = self.first_token_at + first + 2 * self.path_first - self.arrival
        e2e = self.finished_at + last + self.path_first + self.path_last - self.arrival
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
            "lora": self.lora.name if self.lora is not None else None,
            "lora_waited": self.lora_waited,
            "prefilled_tokens": self.prefilled,
            "fetched_tokens": self.fetched_tokens,
            "fetch_s": self.fetch_s,
            "migrations": self.migrations,
        }


class SimReplica:
    """One replica: the real Scheduler, stepped back to back while it has work. `sim` is the
    Simulation (sim/cluster.py) that owns it: its clock, settings and fleet-wide events."""

    def __init__(self, sim, rid: str, created: float) -> None:
        self.sim = sim
        self.rid = rid
        self.speed = 1.0  # its host's step price factor (Simulation.host_speed)
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
        self.lost = False  # died (Simulation._lose_replica): every event of it is void
        self.created = created
        self.stopped_at = math.nan
        self.ongoing = 0  # Ray's in-flight count (routed, not yet finished at the router)
        self.busy = False
        self.host: list[SimReplica] = [self]  # the replicas of its host, itself included
        self.recorded: deque[RoutingStats] = deque()  # reports in flight to the routers
        self.visible: RoutingStats | None = None
        self.preemptions = PreemptionRate()
        self.requests: dict[str, SimRequest] = {}
        self.busy_s = 0.0
        self.num_steps = 0
        self.metric_window: deque[tuple[float, AutoscalingStats]] = deque()
        self.lora_capacity = cfg.lora_capacity
        self.loras: OrderedDict[str, None] = OrderedDict()  # held adapters, least recent first
        self.lora_users: dict[str, int] = {}  # adapter -> its requests on this replica
        self.lora_loading: dict[str, list[SimRequest]] = {}  # adapter -> requests waiting
        self.lora_loads = 0
        self.role: str | None = None  # PD: "prefill" or "decode"
        self.link_free_at = 0.0  # when this replica's egress link finishes its queued fetches
        self.fetches = 0  # fetches into this replica, and the blocks they brought
        self.fetched_blocks = 0
        # tokens per second this replica streams, a moving average over ~STREAM_RATE_TAU_S
        self.stream_rate = 0.0
        self._rate_at = created
        # the scheduler reports the adapters held (RoutingStats.loras) as a replica's does
        self.scheduler.lora_names = lambda: list(self.loras)

    # -- requests --------------------------------------------------------------------------
    def abandon(self, req: SimRequest) -> None:
        """This (lost) replica lets `req` go: what it had computed is gone; the tokens that
        reached the client stay with the request, to resume from on the next replica."""
        request = req.engine_request
        if request is not None:
            req.preemptions += request.num_preemptions
            req.resume_ids = request.all_token_ids[request.num_prompt_tokens :][: req.n_out]
        req.engine_request = None
        req.fetch = None
        self.requests.pop(req.rid, None)

    def receive(self, now: float, req: SimRequest) -> None:
        if self.lost or req.replica is not self:  # it died while the request was on its way
            return
        if req.migrations == 0 or req.recv_at != req.recv_at:  # a resend keeps its first
            req.recv_at = now
        fetch, req.fetch = req.fetch, None
        if fetch is not None:
            source = self.sim.by_rid.get(fetch.source)
            if source is not None and source is not self and source.state != STOPPED:
                done = self._start_fetch(now, req, source, fetch.num_blocks)
                if done is not None:
                    self.sim.at(done, self._fetched, req)
                    return
        self._arrived(now, req)

    def _start_fetch(self, now: float, req: SimRequest, source, num_blocks: int):
        """Queue the transfer of the blocks `source` holds of `req`'s leading `num_blocks`
        that this replica lacks; when it will be done (None: nothing to move)."""
        hashes = self._prompt_hashes(req)[:num_blocks]
        have = _leading(self.scheduler.kv.pool, hashes)
        held = _leading(source.scheduler.kv.pool, hashes)
        if held <= have:
            return None
        moved = held - have
        sim = self.sim
        start = max(now, source.link_free_at)
        done = start + sim.fetch_latency_s + moved * sim.bytes_per_block / sim.transfer_bytes_per_s
        source.link_free_at = done
        req.fetch = KVFetch(source.rid, held)  # kept for _fetched: what to import
        return done

    def _fetched(self, now: float, req: SimRequest) -> None:
        """The fetched blocks arrive: cached here (free, evictable), then the request goes on."""
        if self.lost or req.replica is not self:
            return
        fetch, req.fetch = req.fetch, None
        hashes = self._prompt_hashes(req)[: fetch.num_blocks]
        pool = self.scheduler.kv.pool
        have = _leading(pool, hashes)
        imported = 0
        parent = hashes[have - 1] if have else root_block_hash(req.lora)
        for h in hashes[have:]:
            if pool.num_free_blocks == 0:
                break  # a full cache keeps what it has: the rest is recomputed
            block = pool.get_new_blocks(1)[0]
            pool.cache_block(block, h, parent)
            pool.free_blocks([block])
            parent = h
            imported += 1
        self.fetches += 1
        self.fetched_blocks += imported
        req.fetched_tokens += imported * self.sim.config.engine.block_size
        req.fetch_s += now - req.recv_at
        self._arrived(now, req)

    def _prompt_hashes(self, req: SimRequest) -> list[int]:
        """The block hashes of what the request's replica computes: its prompt (and, in the
        decode phase, its first token), chained from its adapter's root."""
        tokens = list(req.spec.prompt_ids)
        if req.phase == "decode" and req.first_id is not None:
            tokens.append(req.first_id)
        out: list[int] = []
        extend_block_hashes(
            out, tokens, self.sim.config.engine.block_size, root_block_hash(req.lora)
        )
        return out

    def _arrived(self, now: float, req: SimRequest) -> None:
        lora = req.lora
        if lora is None:
            self._admit(now, req)
            return
        self.lora_users[lora.name] = self.lora_users.get(lora.name, 0) + 1
        if lora.name in self.loras:
            self.loras.move_to_end(lora.name)
            self._admit(now, req)
            return
        req.lora_waited = True
        waiting = self.lora_loading.get(lora.name)
        if waiting is not None:  # already loading: it waits for the same load
            waiting.append(req)
            return
        self.lora_loading[lora.name] = [req]
        self.lora_loads += 1
        self.sim.at(now + self.sim.lora_load_s, self._lora_loaded, lora.name)

    def _lora_loaded(self, now: float, name: str) -> None:
        if self.lost:
            return
        self.loras[name] = None
        while len(self.loras) > self.lora_capacity:
            idle = next((n for n in self.loras if not self.lora_users.get(n)), None)
            del self.loras[idle if idle is not None else next(iter(self.loras))]
        for req in self.lora_loading.pop(name):
            self._admit(now, req)

    def _release_lora(self, req: SimRequest) -> None:
        if req.lora is not None:
            name = req.lora.name
            self.lora_users[name] -= 1
            if not self.lora_users[name]:
                del self.lora_users[name]

    def _admit(self, now: float, req: SimRequest) -> None:
        """Hand `req` to the scheduler (its adapter, if any, is loaded)."""
        max_tokens = 1 if req.phase == "prefill" else req.spec.output_len
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        resume = None
        if req.phase == "decode":  # PD: it continues from the first token the prefill made
            resume = Resume([req.first_id], "", 0)
        elif req.resume_ids:  # migrated: it continues from the tokens the client has
            resume = Resume(list(req.resume_ids), "", req.migrations)
        request = Request(
            EngineRequest(
                req.spec.prompt_ids, params, req.rid, arrival_time=now, lora=req.lora,
                resume=resume,
            )
        )  # fmt: skip
        try:
            self.scheduler.add_request(request)
        except RequestRejected:
            self._release_lora(req)
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
        if self.lost:
            return
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
        else:  # the tokens it streams: the requests that sample a token in it
            streamed = sum(1 for s in so.scheduled if s.sample)
            duration = serving_step(serving, self.sim.model, shape, streamed, self.host_busy())
            self._note_streamed(now, 0)  # idle until now
        duration *= self.speed  # its host's price level (SimSettings.host_spread)
        if self.sim.step_trace is not None:  # STEPSERVE_STEP_TRACE's step lines
            self.sim.step_trace.append(
                {
                    "ev": "step", "pid": self.rid, "t": now + duration, "dur": duration,
                    "reqs": [[s.request_id, s.start, s.num_tokens, len(s.draft),
                              s.request.num_prompt_tokens] for s in so.scheduled],
                }
            )  # fmt: skip
        self.busy_s += duration
        self.num_steps += 1
        self.sim.at(now + duration, self._end_step, so)

    def host_busy(self) -> float:
        """The share of the other replicas of its host running steps now (they slow each
        other down: sim/calibrate.py's `corun`)."""
        others = [r for r in self.host if r is not self and not r.lost]
        return sum(r.busy for r in others) / len(others) if others else 0.0

    def _end_step(self, now: float, so) -> None:
        if self.lost:  # it died during the step: nothing of it came out
            return
        sampled = {}
        for s in so.scheduled:
            if s.sample:
                req = self.requests[s.request_id]
                answer = req.planned_answer()
                k = s.request.num_output_tokens
                sampled[s.request_id] = answer[k] if answer and k < len(answer) else FILLER_TOKEN
        outputs = self.scheduler.update_from_output(so, sampled)
        sim = self.sim
        serving = sim.serving
        extra = 0.0
        if serving is not None:
            self._note_streamed(now, len(sampled))
            # the proxy and ingress serve every replica of a host: the calibration's replicas
            extra = path_extra(serving, self.stream_rate * serving.get("replicas", 1))
        if self.events is not None:
            batch = self.events.seal()
            if batch is not None:
                sim.at(now + sim.settings.kv_event_delay_s, sim.deliver_kv_events, (self, batch))
        for out in outputs:
            req = self.requests[out.request_id]
            req.n_out += 1
            if req.n_out == 1:
                req.path_first = extra
                sim.first_token(req, now)
            if out.finish_reason is not None:
                req.path_last = extra
                request_obj = req.engine_request
                req.preemptions += request_obj.num_preemptions
                cached = max(request_obj.num_cached_tokens, 0)
                computed = request_obj.num_prompt_tokens + request_obj.num_resumed_tokens
                req.prefilled += max(computed - cached, 0)
                if req.phase == "prefill" and req.spec.output_len > 1:
                    req.cached_tokens = cached  # the prompt's hit (the decode's is a fetch)
                    req.first_id = request_obj.all_token_ids[request_obj.num_prompt_tokens]
                    req.engine_request = None
                    del self.requests[out.request_id]
                    self._release_lora(req)
                    sim.handed_off(req, now)
                    continue
                if req.phase != "decode":
                    req.cached_tokens = cached
                if req.conv is not None or sim.oracle:  # the next turn's history holds it
                    req.answer = request_obj.all_token_ids[request_obj.num_prompt_tokens :]
                elif req.hashes is None:
                    req.spec.release()  # a lazily made prompt is not needed any more
                req.engine_request = None
                del self.requests[out.request_id]
                self._release_lora(req)
                sim.finish(req, now, "ok")
        if self.scheduler.has_unfinished():
            self._start_step(now)
        else:
            self.busy = False
            if self.state == DRAINING:
                sim.maybe_stop(self, now)

    def _note_streamed(self, now: float, tokens: int) -> None:
        """Fold `tokens` streamed over the time since the last note into `stream_rate`."""
        dt = now - self._rate_at
        if dt <= 0:
            return
        alpha = 1.0 - math.exp(-dt / STREAM_RATE_TAU_S)
        self.stream_rate += alpha * (tokens / dt - self.stream_rate)
        self._rate_at = now

    # -- reports ---------------------------------------------------------------------------
    def record_stats(self, now: float) -> RoutingStats:
        kv = self.scheduler.kv
        stats = RoutingStats.of_scheduler(
            self.rid, now, self.scheduler.stats(), self.sim.config.engine, self.preemptions,
            num_kv_blocks=kv.num_blocks, num_free_blocks=kv.pool.num_free_blocks,
        )  # fmt: skip
        sim = self.sim  # the rates a serving replica measures at start-up
        stats = dataclasses.replace(
            stats,
            prefill_tokens_per_s=sim.prefill_tokens_per_s,
            kv_transfer_bytes_per_s=sim.transfer_bytes_per_s,
            kv_bytes_per_block=sim.bytes_per_block,
        )
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


def _leading(pool, hashes: list[int]) -> int:
    """How many of `hashes`, from the first, `pool` holds cached."""
    n = 0
    for h in hashes:
        if pool.get_cached_block(h) is None:
            break
        n += 1
    return n
