"""A replica's side of KV-event routing: seal a batch of prefix-cache events after every engine
step, where the engine runs (KVEventSealer, a step listener), and publish the sealed batches to
the application's KVEventHub (replica/kv_events.py) from a thread of the replica
(KVEventPublisher) every `interval_s`, with a heartbeat when there is nothing new. When the hub
asks for a resync (it restarted, or it missed a batch), the next publish carries a snapshot
taken by the engine between two steps. Costs are counted (`seal_seconds`, `publish_seconds`) so
that the per-step overhead can be stated.

A replica publishes only while a router reads it (`set_active`, from the hub's answer to the
replica's metrics push about once a second: KVEventHub.is_read). A router polls only while it
has two replicas or more to choose from, so a replica alone in its application (the default
`stepserve serve`, until autoscaling adds one) spends nothing on KV events: its batches are
sealed (the table a snapshot needs stays exact) and dropped. When a router starts reading
it, the first publish carries a snapshot; when none has read it for READ_TTL_S, it stops and
the hub forgets it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from replica.kv_events import KVEventBatch, KVSnapshot, call_hub

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0


class KVEventSealer:
    """The engine's side: turns on the KV pool's event log and seals a batch after every step
    (a step listener, where the engine runs), handing each batch to `sink`."""

    def __init__(self, engine, sink=None) -> None:
        self.log = engine.scheduler.kv.pool.enable_events(engine.config.block_size)
        self.sink = sink
        self.seal_seconds = 0.0
        self.num_steps = 0
        engine.step_listeners.append(self._on_step)

    def _on_step(self, engine, scheduler_output, outputs, step_time) -> None:
        t0 = time.perf_counter()
        batch = self.log.seal()
        if batch is not None and self.sink is not None:
            self.sink(batch)
        self.num_steps += 1
        self.seal_seconds += time.perf_counter() - t0

    def stats(self) -> dict:
        return {
            "seq": self.log.seq,
            "events": self.log.num_events,
            "blocks": len(self.log.table),
            "steps": self.num_steps,
            "seal_seconds": self.seal_seconds,
        }


class KVEventPublisher:
    """The replica's side: queues sealed batches (`add_batch`, from any thread) and publishes
    them while active (`set_active`). `snapshot()` returns the engine's table (taken between two
    steps) for a resync; `log_stats()` the sealer's counters; `on_active(bool)`, when given, is
    told of each change first (an engine core stops or starts sending its batches).
    `in_process` wires one to an AsyncEngine's Engine. `hub` is the hub's actor handle, or a
    KVEventHub in this process (tests)."""

    def __init__(
        self,
        replica_id: str,
        hub,
        snapshot,
        log_stats,
        interval_s: float = 0.02,
        max_pending: int = 4096,
        active: bool = False,
        on_active=None,
    ) -> None:
        self.replica_id = replica_id
        self.hub = hub
        self.snapshot = snapshot
        self.log_stats = log_stats
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.on_active = on_active
        self._pending: deque[KVEventBatch] = deque()
        self._lock = threading.Lock()
        self._active = active
        self._resync = active  # a publisher's first batch may not be the engine's first
        self._stop = threading.Event()
        self._news = threading.Event()  # set when a batch is sealed: the publisher wakes
        self.publish_seconds = 0.0
        self.num_published = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def in_process(cls, async_engine, replica_id: str, hub, **kwargs) -> KVEventPublisher:
        sealer = KVEventSealer(async_engine.engine)
        publisher = cls(
            replica_id,
            hub,
            snapshot=lambda: async_engine.call_on_engine_thread(
                lambda engine: sealer.log.snapshot()
            ).result(timeout=30),
            log_stats=sealer.stats,
            **kwargs,
        )
        sealer.sink = publisher.add_batch
        return publisher

    @property
    def active(self) -> bool:
        return self._active

    def set_active(self, active: bool) -> None:
        """Start publishing (with a snapshot first) or stop (the hub forgets this replica)."""
        if active == self._active:
            return
        if active:
            with self._lock:  # take batches before the engine sends them: none is lost
                self._active = True
                self._resync = True
            self._tell_engine(True)
            self._news.set()
            logger.info("replica %s: a router reads its KV events: publishing", self.replica_id)
            return
        with self._lock:
            self._active = False
            self._pending.clear()
        self._tell_engine(False)
        self._hub_call("forget", self.replica_id, wait=False)
        logger.info("replica %s: no router reads its KV events: not publishing", self.replica_id)

    def _tell_engine(self, active: bool) -> None:
        """on_active(active); when it fails (the engine core did not answer), this publisher
        goes back to the state the engine is still in, so the next answer of the hub tries
        again, rather than believe it publishes while the engine sends nothing."""
        if self.on_active is None:
            return
        try:
            self.on_active(active)
        except BaseException:
            with self._lock:
                self._active = not active
                self._pending.clear()
                self._resync = True
            raise

    def _hub_call(self, method: str, *args, wait: bool = True):
        return call_hub(self.hub, method, *args, wait=wait)

    def add_batch(self, batch: KVEventBatch) -> None:
        if not self._active:  # nobody reads: the snapshot that starts publishing covers it
            return
        with self._lock:
            if not self._active:
                return
            self._pending.append(batch)
            if len(self._pending) > self.max_pending:  # the hub is not keeping up: resync
                self._pending.clear()
                self._resync = True
        self._news.set()

    # -- publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        """Wakes when a step sealed a batch (at most every interval_s, so that a busy engine's
        batches travel together), or for a heartbeat; an idle replica costs nothing."""
        last = 0.0
        while not self._stop.is_set():
            self._news.wait(HEARTBEAT_S)
            if self._stop.wait(self.interval_s):  # let a burst of steps coalesce
                break
            self._news.clear()
            try:
                last = self.publish_once(last)
            except Exception as exc:  # the hub is gone or slow: resync once it is back
                logger.warning("replica %s: KV events not published (%s)", self.replica_id, exc)
                self._resync = True
                self._stop.wait(1.0)
                self._news.set()

    def publish_once(self, last: float = 0.0) -> float:
        if not self._active:
            return last
        snapshot: KVSnapshot | None = None
        if self._resync:
            snapshot = self.snapshot()
            self._resync = False
        with self._lock:
            batches = list(self._pending)
            self._pending.clear()
        if snapshot is not None:  # batches up to the snapshot are in it
            batches = [b for b in batches if b.seq > snapshot.seq]
        now = time.time()
        if not batches and snapshot is None and now - last < HEARTBEAT_S:
            return last
        t0 = time.perf_counter()
        reply = self._hub_call("publish", self.replica_id, batches, snapshot)
        self.publish_seconds += time.perf_counter() - t0
        if not self._active:  # stopped while this publish was on its way: it must not stay
            self._hub_call("forget", self.replica_id, wait=False)
            return now
        self.num_published += len(batches)
        if reply.get("resync"):
            self._resync = True
            self._news.set()  # send the snapshot without waiting for the next step
        return now

    def stats(self) -> dict:
        return {
            **self.log_stats(),
            "publish_seconds": self.publish_seconds,
            "batches_published": self.num_published,
            "publishing": self._active,
        }

    def stop(self) -> None:
        self._stop.set()
        self._news.set()
        try:
            self._hub_call("forget", self.replica_id, wait=False)
        except Exception:
            pass
