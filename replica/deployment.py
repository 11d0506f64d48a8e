"""The Ray Serve replica: one engine per actor (its core in a process of its own, ProcessEngine,
or in a thread, AsyncEngine), streaming RequestOutput deltas, reporting routing and autoscaling
stats, and failing its health check when the engine is dead."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import ray
from prometheus_client import start_http_server
from ray import serve

from replica import tracing as replica_tracing
from replica.config import EngineConfig
from replica.contracts import (
    ACCEPTED_NOTICE_S,
    Accepted,
    AutoscalingStats,
    Fed,
    GenerateRequest,
    PreemptionRate,
    RoutingStats,
)
from replica.engine import AsyncEngine, Engine
from replica.engine.core_client import ProcessEngine
from replica.engine.wire import CoreOp
from replica.errors import ReplicaDraining
from replica.feed import FeedClients, FeedConnection
from replica.hub import get_hub
from replica.kv_publisher import KVEventPublisher
from replica.kv_transfer import KVExport, call_replica, prompt_block_hashes
from replica.metrics import EngineMetrics
from replica.request import RequestOutput
from replica.startup import freeze_heap, process_age_s

logger = logging.getLogger("ray.serve")

# Window over which the recent preemption rate is computed for routing and autoscaling.
_PREEMPTION_WINDOW_S = 10.0
METRICS_PUSH_PERIOD_S = 1.0
METRICS_PUSH_TIMEOUT_S = 10.0
# an exposition unchanged since the last push (an idle replica) is pushed again only this often:
# the hub keeps it (it ages out after 30 s) and /metrics shows the same; a change goes out at the
# next period. What waits up to this long: an idle replica learning that a router now reads its
# KV events (a second replica joined), which its first request's push would tell it anyway
METRICS_IDLE_PUSH_PERIOD_S = 10.0
# The threads of a replica's actor take turns on the GIL: the event loop that streams outputs,
# Ray's threads, and the engine thread (engine_core="thread": it holds the GIL between torch
# ops) or the core's reader (engine_core="process": it detokenizes each step). Python's
# default 5 ms switch interval makes each wait up to that long; 0.5 ms keeps hand-offs short.
GIL_SWITCH_INTERVAL_S = 0.0005
# how often a replica that hands its streams back when draining looks for Serve's shutdown
SHUTDOWN_POLL_S = 0.25
# how often a draining replica asks Serve whether another replica runs to take its requests
SUCCESSOR_POLL_S = 1.0


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (a
    Kubernetes limit), which os.cpu_count() ignores."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cpus, quota) if quota else cpus)


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's CPU limit in whole CPUs (rounded up), or None when there is none."""
    try:  # cgroup v2: "<quota> <period>" or "max <period>"
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return max(1, -(-int(quota) // int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return max(1, -(-quota_us // period_us)) if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def resolve_cpu_threads(settings: dict) -> int:
    """Torch threads of a CPU replica from its user_config (cluster.app.thread_settings):
    `cpu_threads` when set; else the CPUs Ray reserves per replica when at least one (the cores
    the replica owns); else this machine's usable cores divided among the replicas sharing it."""
    if settings.get("cpu_threads"):
        return int(settings["cpu_threads"])
    if settings.get("num_cpus_per_replica", 0) >= 1:
        return int(settings["num_cpus_per_replica"])
    return max(1, usable_cpus() // max(int(settings.get("replicas_per_machine") or 1), 1))


def serve_shutting_down() -> bool | None:
    """Whether Ray Serve has begun this replica's graceful shutdown (scale-down, redeploy, the
    application deleted). Serve tells a replica's code nothing until the drain is over (then it
    calls __del__), so this reads the flag Serve's replica actor sets as the shutdown starts;
    None where it cannot be read (outside a Serve replica, a Ray whose internals differ)."""
    try:
        worker = ray._private.worker.global_worker
        flag = worker.actors[worker.actor_id]._replica_impl._shutting_down
    except Exception:
        return None
    return flag if isinstance(flag, bool) else None


def successor_running() -> bool:
    """Whether this replica's deployment has a RUNNING replica (this one, shutting down, is
    STOPPING): a request handed back needs one. Not when the application is being deleted."""
    try:
        context = serve.get_replica_context()
        app = serve.status().applications[context.app_name]
        if app.status == "DELETING":
            return False
        return app.deployments[context.deployment].replica_states.get("RUNNING", 0) > 0
    except Exception:
        return False


class LLMServer:
    """Deployment class (wrapped with serve.deployment by cluster/app.py).
    `drain_migrate_after_s`: when Serve drains this replica, the requests still unfinished
    this long after the drain began are handed back (ReplicaDraining), for the ingress to
    continue on another replica (router/fanout.py); None: they are waited for."""

    # draining: set once unfinished requests are handed back (_watch_shutdown); the event wakes
    # the streams still waiting for their first output, in the loop that serves them
    _hands_back = False  # a drain hands requests back (the watcher runs)
    _handing_back = False
    _hand_back_event: asyncio.Event | None = None
    _serving_loop: asyncio.AbstractEventLoop | None = None
    metrics: EngineMetrics | None = None  # set in __init__ (tests build a bare server)
    # measured at start-up (_measure_kv_costs): RoutingStats' cost figures; none until then
    kv_costs: dict = {}
    _embedding: dict | None = None  # model_info's "embedding", read once
    _feeds: FeedClients | None = None  # the direct feeds to ingresses (made at the first)

    def __init__(
        self,
        engine_config: dict,
        kv_events: bool = False,
        drain_migrate_after_s: float | None = None,
        tracing: dict | None = None,
    ) -> None:
        config = EngineConfig.model_validate(engine_config)
        replica_tracing.configure(tracing)  # OpenTelemetry spans (off: None)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.deployment_name = "LLMServer"
        try:
            context = serve.get_replica_context()
            self.replica_id, app = context.replica_id.unique_id, context.app_name
            self.deployment_name = context.deployment
        except Exception:  # outside Serve (direct actor use in tests)
            self.replica_id, app = f"pid-{os.getpid()}", "default"
        self.app_name = app
        entered, age = time.time(), process_age_s()
        # the application's hub (metrics, KV events): asked for first, so that its process,
        # when this replica is the one that creates it, starts while the engine builds
        self.hub = get_hub(app)
        # the engine core in a process of its own (tp=1), or in a thread of this actor
        self.core_process = config.engine_core == "process" and config.tensor_parallel_size == 1
        if self.core_process:
            # loading and warm-up use every usable core; the serving count arrives in
            # reconfigure (user_config) before the first request
            self.engine = ProcessEngine(config, kv_events=kv_events, num_threads=usable_cpus())
        else:
            if config.resolved_device() != "cuda":
                import torch

                # as above (Ray sets OMP_NUM_THREADS=1 for an actor with fractional CPUs)
                torch.set_num_threads(usable_cpus())
            self.engine = AsyncEngine(Engine(config))
        self.config = config
        self._embedding: dict | None = None  # model_info's "embedding", read once
        # where this replica's start went: the worker process's boot and imports until this
        # constructor ran, then the engine's phases (Engine.startup_s)
        self.startup_s = {
            "process": round(age, 3),
            "engine": round(time.time() - entered, 3),
            **{f"engine.{k}": v for k, v in self.engine.info.startup_s.items()},
        }
        self.kv_events: KVEventPublisher | None = None
        if kv_events:  # routers mirror this replica's prefix cache (router/kv_index.py)
            hub = self.hub
            if self.core_process:
                engine = self.engine
                self.kv_events = KVEventPublisher(
                    self.replica_id,
                    hub,
                    snapshot=lambda: engine.call(CoreOp.KV_SNAPSHOT).result(timeout=30),
                    log_stats=lambda: engine.call(CoreOp.KV_STATS).result(timeout=30),
                    on_active=lambda on: engine.call(CoreOp.KV_PUBLISH, on).result(timeout=30),
                )
                engine.kv_batch_listener = self.kv_events.add_batch
            else:
                self.kv_events = KVEventPublisher.in_process(self.engine, self.replica_id, hub)
        self._preemptions = PreemptionRate(_PREEMPTION_WINDOW_S)
        model_name = config.served_name()
        sizes = {
            "max_model_len": self.engine.max_model_len,
            "cache_info": {
                "block_size": config.block_size,
                "num_gpu_blocks": self.engine.info.num_kv_blocks,
                "enable_prefix_caching": config.enable_prefix_caching,
            },
        }
        if self.core_process:  # the front observes the steps the core reports
            self.metrics = EngineMetrics(None, model_name, self.replica_id, **sizes)
            self.engine.report_listeners.append(self.metrics.observe)
        else:
            self.metrics = EngineMetrics(self.engine.engine, model_name, self.replica_id, **sizes)
        self._metrics_stop = threading.Event()
        threading.Thread(target=self._push_metrics, name="metrics-push", daemon=True).start()
        if drain_migrate_after_s is not None:
            if serve_shutting_down() is None:
                logger.warning(
                    "replica %s: cannot see Serve's shutdown; a drain waits for its requests",
                    self.replica_id,
                )
            else:
                self._hands_back = True
                threading.Thread(
                    target=self._watch_shutdown,
                    args=(drain_migrate_after_s,),
                    name="drain-watch",
                    daemon=True,
                ).start()
        port = os.environ.get("STEPSERVE_METRICS_PORT")
        if port:  # one scrape target per pod in Kubernetes (the chart sets this)
            try:
                start_http_server(int(port), registry=self.metrics.registry)
            except OSError as exc:
                logger.warning("metrics port %s unavailable (%s); hub only", port, exc)
        # the costs a router weighs a KV fetch by (RoutingStats), measured once now
        self.kv_costs = self._measure_kv_costs()
        self.metrics.kv_block_bytes = self.kv_costs["kv_bytes_per_block"]
        freeze_heap()  # started (again after the front's tokenizer load: ProcessEngine)
        logger.info(
            "replica %s ready: max_model_len=%d, %d KV blocks of %d tokens",
            self.replica_id,
            self.engine.max_model_len,
            self.engine.info.num_kv_blocks,
            config.block_size,
        )

    def _measure_kv_costs(self) -> dict:
        """prefill_tokens_per_s, kv_transfer_bytes_per_s, kv_bytes_per_block (kv_transfer.py
        measure_engine: a 32-token prefill, and the in-process copy out and in of its blocks;
        the transfer rate also counts a put and get of as many bytes through Ray's object
        store, the hop between two replicas on one node). Zeros when it cannot measure."""
        costs = {"prefill_tokens_per_s": 0.0, "kv_transfer_bytes_per_s": 0.0,
                 "kv_bytes_per_block": 0}  # fmt: skip
        try:
            if self.core_process:
                measured = self.engine.call(CoreOp.KV_MEASURE).result(timeout=60)
            else:
                from replica.kv_transfer import measure_engine

                measured = self.engine.call_on_engine_thread(measure_engine).result(timeout=60)
            costs["prefill_tokens_per_s"] = measured["prefill_tokens_per_s"]
            costs["kv_bytes_per_block"] = measured["kv_bytes_per_block"]
            copy_rate = measured["kv_copy_bytes_per_s"]
            if copy_rate and ray.is_initialized():
                import numpy as np

                size = max(measured["kv_bytes_per_block"] * 4, 1 << 16)
                started = time.perf_counter()
                ray.get(ray.put(np.zeros(size, dtype=np.uint8)))
                store_rate = size / max(time.perf_counter() - started, 1e-9)
                copy_rate = 1.0 / (1.0 / copy_rate + 1.0 / store_rate)
            costs["kv_transfer_bytes_per_s"] = round(copy_rate)
        except Exception as exc:  # figures only: the replica serves without them
            logger.warning("replica %s: KV cost figures not measured: %s", self.replica_id, exc)
        return costs

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this after __init__ and, in place, whenever user_config changes (a
        replica-count change moves the auto thread count): the torch threads of the engine."""
        device = self.engine.device if self.core_process else self.config.resolved_device()
        if device == "cuda":
            return
        threads = resolve_cpu_threads(user_config)
        if self.config.tensor_parallel_size > 1:
            # the ranks split this process's threads when the group started; they keep it
            logger.info(
                "replica %s: tensor-parallel group keeps its startup thread split; "
                "cpu_threads=%d not applied",
                self.replica_id,
                threads,
            )
            return
        self.engine.set_num_threads(threads)

    def _outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The engine's stream of the request (no wrapper per token), or, with a kv_fetch,
        one that fetches the prefix first."""
        if self.metrics is not None:  # its max_tokens and trace context, for its end
            self.metrics.taken(request)
        if request.kv_fetch is None:
            return self.engine.generate(request)
        return self._fetched_outputs(request)

    async def _fetched_outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        await self._fetch_kv(request)  # its prefix's KV from the replica holding it first
        inner = self.engine.generate(request)
        try:
            async for out in inner:
                yield out
        finally:
            await inner.aclose()  # at once: closing the engine's stream aborts the request

    # -- KV transfer between replicas (replica/kv_transfer.py) ------------------------------
    async def export_kv(self, hashes: list[int]) -> KVExport:
        """The leading run of these block hashes this replica holds, copied out with its
        layout (another replica's fetch calls this, through Ray)."""
        self.metrics.kv_export_calls.inc()
        export = await self._engine_call(
            CoreOp.KV_EXPORT, None, "export_kv", hashes, blob=pickle.dumps(hashes)
        )
        self.metrics.kv_blocks_exported.inc(len(export.hashes))
        self.metrics.kv_bytes_exported.inc(export.nbytes)
        return export

    def _fetch_timeout_s(self, num_blocks: int) -> float:
        """A fetch is worth waiting for no longer than recomputing its tokens would take (at
        the measured prefill rate), and at least a second (Ray's own call overhead)."""
        rate = self.kv_costs.get("prefill_tokens_per_s") or 0.0
        recompute = num_blocks * self.config.block_size / rate if rate else 5.0
        return min(max(1.0, 2.0 * recompute), 30.0)

    async def _fetch_kv(self, request: GenerateRequest) -> None:
        """Import the prompt's first kv_fetch.num_blocks blocks from kv_fetch.source; on any
        failure the request just recomputes them (counted by reason)."""
        fetch = request.kv_fetch
        if not self.config.kv_transfer or fetch.num_blocks < 1:
            self.metrics.kv_fetch_failures("off").inc()
            return
        if fetch.source == self.replica_id:
            return  # its own cache serves it
        tokens = request.prompt_token_ids
        if request.resume is not None:  # a migrated request's chain runs on through its output
            tokens = [*tokens, *request.resume.output_token_ids]
        hashes = prompt_block_hashes(tokens, self.config.block_size, request.lora, fetch.num_blocks)
        if not hashes:
            return
        started = time.perf_counter()
        reason = None
        try:
            ref = call_replica(
                self.app_name, self.deployment_name, fetch.source, "export_kv", hashes
            )
            export = await asyncio.wait_for(ref, self._fetch_timeout_s(len(hashes)))
            result = await self._engine_call(
                CoreOp.KV_IMPORT,
                None,
                "import_kv",
                export,
                hashes,
                blob=pickle.dumps((export, hashes)),
            )
            reason = result.refused
            if result.imported:
                self.metrics.kv_blocks_imported.inc(result.imported)
                self.metrics.kv_bytes_imported.inc(result.nbytes)
            if result.imported < len(hashes) and reason is None:
                reason = "partial"  # the source held fewer (evicted meanwhile)
        except asyncio.TimeoutError:
            reason = "timeout"
        except ValueError:  # ray.get_actor: no such replica (gone)
            reason = "source_gone"
        except Exception as exc:
            logger.warning("replica %s: KV fetch from %s failed: %r", self.replica_id,
                           fetch.source, exc)  # fmt: skip
            reason = "error"
        self.metrics.kv_fetch_seconds.observe(time.perf_counter() - started)
        if reason is not None:
            self.metrics.kv_fetch_failures(reason).inc()

    # -- handing requests back when draining ---------------------------------------------
    def _watch_shutdown(self, grace_s: float) -> None:
        """Wait for Serve's shutdown of this replica, then `grace_s` more for requests to
        finish; then hand the unfinished ones back (the streams raise ReplicaDraining), once
        another replica of the deployment runs to take them (none when the whole
        application is deleted: then the drain waits for them, as without hand-backs)."""
        while not self._metrics_stop.wait(SHUTDOWN_POLL_S):
            if serve_shutting_down():
                break
        else:
            return
        logger.info(
            "replica %s: draining; requests unfinished in %.1f s are handed back to the ingress",
            self.replica_id,
            grace_s,
        )
        if self._metrics_stop.wait(grace_s):
            return
        while not successor_running():
            if self._metrics_stop.wait(SUCCESSOR_POLL_S):
                return
        self._handing_back = True
        loop, event = self._serving_loop, self._hand_back_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # a loop closed has no stream to wake
                loop.call_soon_threadsafe(event.set)  # the streams before their first output

    def _hand_back(self, request: GenerateRequest) -> ReplicaDraining:
        return ReplicaDraining(
            f"replica {self.replica_id} is draining and handed request {request.request_id} back",
            self.replica_id,
        )

    async def _first_output(self, first: asyncio.Future, request: GenerateRequest):
        """The first output (StopAsyncIteration: none), or ReplicaDraining raised when the
        replica hands its requests back before it comes."""
        if not self._hands_back:
            return await asyncio.shield(first)
        if self._hand_back_event is None:
            self._serving_loop = asyncio.get_running_loop()
            self._hand_back_event = asyncio.Event()
            if self._handing_back:
                self._hand_back_event.set()
        waiter = asyncio.ensure_future(self._hand_back_event.wait())
        try:
            await asyncio.wait({first, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not first.done():
            raise self._hand_back(request)
        return first.result()

    def _feed_of(self, request: GenerateRequest) -> FeedConnection | None:
        """The connection to the request's direct feed (connecting, at its ingress's first
        request), or None when it asks for none."""
        if request.feed is None:
            return None
        if self._feeds is None:
            self._feeds = FeedClients()
        return self._feeds.get(request.feed)

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[RequestOutput | Accepted | Fed]:
        """RequestOutput deltas of one choice, after an Accepted when the first of them takes
        longer than ACCEPTED_NOTICE_S; a refusal (queue full, draining, a bad request) raises
        before anything is sent, and a draining replica that hands its requests back raises
        ReplicaDraining wherever the stream is. Cancellation aborts the request. With a direct
        feed (`request.feed`, reachable) the deltas go there instead, and the call ends with
        Fed(their count); a feed that breaks raises FeedBroken (the ingress migrates the
        stream); one that cannot be reached leaves the deltas on this call."""
        feed = self._feed_of(request)  # connects during the prefill, at an ingress's first
        outputs = self._outputs(request)
        first = asyncio.ensure_future(anext(outputs))
        # a constrained request's grammar compiles first, and a grammar that cannot compile is
        # a 400: it gets twice as long before the response starts
        notice_s = ACCEPTED_NOTICE_S * (1 if request.sampling.structured is None else 2)
        try:
            done, _ = await asyncio.wait({first}, timeout=notice_s)
            if not done:
                yield Accepted(request.request_id)
            try:
                out = await self._first_output(first, request)
            except StopAsyncIteration:
                return
            if feed is not None and not await feed.ready():
                self._feeds.fallbacks += 1
                feed = None
            if feed is not None:
                feed.send(out)
                count = 1
                async for out in outputs:
                    if self._handing_back and not out.finished:  # a last delta still goes out
                        raise self._hand_back(request)
                    feed.send(out)
                    count += 1
                yield Fed(request.request_id, count)
                return
            yield out
            async for out in outputs:
                if self._handing_back and not out.finished:  # a last delta still goes out
                    raise self._hand_back(request)
                yield out
        finally:
            if not first.done():  # cancelled while waiting: the engine's stream aborts it
                first.cancel()
                await asyncio.wait({first})  # a second cancellation still propagates
            if not first.cancelled():
                first.exception()  # retrieved (raised above, or moot once cancelled)
            await outputs.aclose()

    async def generate_all(self, request: GenerateRequest) -> RequestOutput:
        """The whole answer as one RequestOutput (all deltas merged): what a non-streaming
        client needs, without a message per token. Cancellation aborts the request; a draining
        replica that hands its requests back raises ReplicaDraining (the ingress sends the call
        again from scratch: nothing of it reached the client)."""
        result = None
        async for out in self._outputs(request):
            if self._handing_back:
                raise self._hand_back(request)
            result = out if result is None else result.merge(out)
        return result

    def _embedding_info(self) -> dict:
        if self._embedding is None:
            from replica.loader import load_hf_config
            from replica.pooling import embedding_info

            info = embedding_info(load_hf_config(self.config.model_dir()))
            self._embedding = {**info, "pooling_type": self.config.pooling_type}
        return self._embedding

    def model_info(self) -> dict:
        info = self.engine.info
        return {
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
            "num_kv_blocks": info.num_kv_blocks,
            "block_size": self.config.block_size,
            "scheduling_policy": self.config.scheduling_policy,
            "replica_id": self.replica_id,
            "startup_s": self.startup_s,
            "weight_bytes": info.weight_bytes,
            # what /v1/embeddings checks `dimensions` against (replica/pooling.py)
            "embedding": self._embedding_info(),
            "lora": {
                "enabled": self.config.lora_enabled,
                "max_loras": self.config.max_loras,
                "max_lora_rank": self.config.max_lora_rank,
                "max_cpu_loras": self.config.lora_capacity,
            },
        }

    # -- LoRA adapters (replica/lora/): run on the engine between two steps -----------------
    async def _engine_call(self, op: CoreOp, arg, method: str, *args, blob: bytes | None = None):
        if self.core_process:
            future = (
                self.engine.call(op, arg, blob) if blob is not None else self.engine.call(op, arg)
            )
        else:
            future = self.engine.call_on_engine_thread(
                lambda engine: getattr(engine, method)(*args)
            )
        return await asyncio.wrap_future(future)

    async def load_lora(self, name: str, path: str) -> dict:
        """Load a LoRA adapter (PEFT directory on this node) now: {name, rank,
        target_modules, load_s}; LoRAError (HTTP 400) names what is wrong."""
        return await self._engine_call(CoreOp.LORA_ADD, [name, path], "add_lora", name, path)

    async def unload_lora(self, name: str) -> bool:
        """Drop an adapter (once its requests end, if any run); False when not loaded."""
        return await self._engine_call(CoreOp.LORA_REMOVE, name, "remove_lora", name)

    async def list_loras(self) -> list[str]:
        """The adapters this replica holds loaded, least recently used first."""
        return await self._engine_call(CoreOp.LORA_LIST, None, "list_loras")

    def routing_stats(self) -> RoutingStats:
        """Engine counters as of the last step, and whether the engine is healthy."""
        engine = self.engine
        stalled = engine.stalled_s()
        healthy = self.engine.error is None and stalled <= self.config.stall_timeout_s
        return RoutingStats.of_scheduler(
            self.replica_id,
            time.time(),
            self.engine.stats(),
            self.config,
            self._preemptions,
            num_kv_blocks=engine.info.num_kv_blocks,
            num_free_blocks=engine.num_free_blocks,
            num_unfinished=self.engine.num_unfinished(),
            num_request_states=engine.num_request_states,
            cpu_threads=self.engine.num_threads,
            healthy=healthy,
            stalled_s=stalled,
            kv_tier_blocks=self.engine.stats().kv_tier_blocks,
            **self.kv_costs,
        )

    def stats(self) -> dict:
        """`routing_stats` as a dict, and the Ray node this replica runs on (a handle call:
        tests, the soak, benchmarks)."""
        feeds = self._feeds
        return self.routing_stats().as_dict() | {
            "node_id": _node_id(),
            # streams that asked for a direct feed it could not reach (they went over Ray)
            "feed_fallbacks": feeds.fallbacks if feeds is not None else 0,
        }

    async def record_routing_stats(self) -> dict:
        return self.routing_stats().as_dict()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return AutoscalingStats.of(self.routing_stats()).as_dict()

    async def check_health(self) -> None:
        """Serve's liveness check (every health_check_period_s): raising makes Serve replace
        this replica; the engine raises when dead or stalled (AsyncEngine.check_health)."""
        self.engine.check_health()

    def inject_stall(self, seconds: float) -> None:
        """Fault injection for tests: block the engine thread for `seconds`, as a stuck
        forward would. Only with STEPSERVE_FAULT_INJECTION=1 in the replica's environment."""
        if os.environ.get("STEPSERVE_FAULT_INJECTION") != "1":
            raise PermissionError("fault injection is off (STEPSERVE_FAULT_INJECTION=1)")
        self.engine.inject_stall(seconds)

    async def drain(self, timeout_s: float) -> bool:
        self.engine.start_draining()
        return await self.engine.wait_drained(timeout_s)

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def _push_metrics(self) -> None:
        """Push the exposition to the hub about once a second, an unchanged one only every
        METRICS_IDLE_PUSH_PERIOD_S (an idle replica: no Ray call, no wake-up of the hub); the
        answer says whether a router reads this replica's KV events (kv_publisher.py: publish
        only then)."""
        last, pushed_at = b"", 0.0
        while not self._metrics_stop.wait(METRICS_PUSH_PERIOD_S):
            try:
                text = self.metrics.exposition()
                now = time.monotonic()
                if text == last and now - pushed_at < METRICS_IDLE_PUSH_PERIOD_S:
                    continue
                last, pushed_at = text, now
                ref = self.hub.push.remote(self.replica_id, text)
                if self.kv_events is not None:
                    self.kv_events.set_active(bool(ray.get(ref, timeout=METRICS_PUSH_TIMEOUT_S)))
                    self.metrics.kv_events_publishing.set(self.kv_events.active)  # next push
            except Exception as exc:  # metrics must not kill the replica
                logger.debug("metrics push failed: %s", exc)

    def kv_events_state(self) -> dict | None:
        """The KV-event publisher's counters and this replica's cached-hash table, as of its
        last sealed batch (tests compare it with the routers' index)."""
        if self.kv_events is None:
            return None
        snapshot = self.kv_events.snapshot()
        return {**self.kv_events.stats(), "replica_id": self.replica_id, "snapshot_seq": snapshot.seq,
                "hashes": sorted(snapshot.blocks)}  # fmt: skip

    def __del__(self) -> None:
        try:
            if self.kv_events is not None:
                self.kv_events.stop()
        except Exception:
            pass
        try:
            if self._feeds is not None:
                self._feeds.close()
        except Exception:
            pass
        try:
            self._metrics_stop.set()
            self.engine.shutdown()
        except Exception:
            pass
        replica_tracing.shutdown()  # the spans still batched


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
