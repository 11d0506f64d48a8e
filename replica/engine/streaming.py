"""The caller's side of a serving engine: one async stream of deltas per request."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

from replica.config import EngineConfig
from replica.engine.wire import EngineInfo
from replica.limits import EngineLimits
from replica.request import EngineDeadError, EngineOverloaded, EngineRequest, RequestOutput
from replica.scheduler import SchedulerStats


class StreamingEngine:
    """The caller's side of a serving engine, shared by AsyncEngine (the engine in a thread of
    this process) and ProcessEngine (engine/core_client.py: an engine core in a process of its
    own): admission to the replica's queue, one async stream of deltas per request, abort when
    a caller leaves, draining, and stall detection. Subclasses say how requests reach the
    engine (`_prepare`, `_submit`, `abort`) and whether it still runs
    (`_check_engine`); they call `_dispatch` with each step's outputs, on the event loop."""

    info: EngineInfo  # set by the subclass once its engine is built
    num_free_blocks: int  # KV blocks free as of the engine's last step
    num_request_states: int  # requests the engine keeps state for (0 when idle)

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop | None) -> None:
        self.config = config
        self._loop = loop
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopped = False
        self._draining = False
        self.error: BaseException | None = None
        self.num_threads = 0  # torch intra-op threads of the engine, once it runs
        # monotonic time the engine last finished a step or found nothing to do: with
        # requests held and this too old, the engine is stuck (check_health)
        self._progress_at = time.monotonic()

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @functools.cached_property
    def limits(self) -> EngineLimits:
        """What this engine can serve: the request check (replica/limits.py)."""
        info, config = self.info, self.config
        return EngineLimits(
            info.max_model_len,
            info.vocab_size,
            info.num_kv_blocks,
            config.block_size,
            config.scheduling_policy,
        )

    def stalled_s(self) -> float:
        """Seconds the engine has held requests without finishing a step (0 when it is idle
        or making progress)."""
        if not self._streams:
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine cannot serve: its loop or process died, a
        tensor-parallel rank is gone, or it has held requests for stall_timeout_s without
        finishing a step (a stuck forward, a hung collective). A stalled engine's streams end
        with the error now, rather than when the replica is replaced."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}") from self.error
        self._check_engine()
        stalled = self.stalled_s()
        limit = self.config.stall_timeout_s
        if stalled > limit:
            error = EngineDeadError(
                f"engine stalled: no step finished for {stalled:.1f} s with "
                f"{len(self._streams)} requests in flight (stall_timeout_s={limit:g})"
            )
            if self.error is None:
                self.error = error
                for rid in list(self._streams):
                    self._deliver_error(rid, error)
            raise error

    def stats(self) -> SchedulerStats:
        """Counters as of the end of the last step (never blocks on the engine)."""
        return self._stats

    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream of RequestOutput deltas; the last has finish_reason set. Leaving the stream
        early (client gone, task cancelled) aborts the request and frees its KV blocks."""
        self.check_health()
        if self._draining:
            raise EngineOverloaded("replica is draining and takes no new requests")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self.limits.check(
            request.prompt_token_ids,
            request.sampling,
            request.priority,
            request.resume,
            request.pooling,
        )
        # Every request this replica holds has a stream (registered here at once, so a burst
        # that lands within one step is counted in full). Those beyond the seats that can run
        # are waiting: all max_num_seqs seats, unless the last step already left requests
        # waiting (KV cache or token budget full); then only as many as ran in it. A replica
        # never holds more than max_num_seqs + max_queue_len requests.
        stats = self._stats
        seats = stats.num_running if stats.num_waiting else self.config.max_num_seqs
        waiting = len(self._streams) - seats
        if waiting >= self.config.max_queue_len:
            raise EngineOverloaded(
                f"replica queue is full ({waiting} waiting >= max_queue_len="
                f"{self.config.max_queue_len})"
            )
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"duplicate request id {rid!r}")
        await self._prepare()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        try:
            self._submit(request.arrived())
        except BaseException:  # refused on the way in (a resume whose text does not match)
            self._streams.pop(rid, None)
            raise
        finished = False
        try:
            held: BaseException | None = None  # an error queued behind deltas, raised next
            while True:
                item = held or await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # a consumer behind the engine gets every delta queued so far as one
                while not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        held = later
                        break
                    item = item.merge(later)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def start_draining(self) -> None:
        """Refuse new requests; in-flight ones run to completion."""
        self._draining = True

    async def wait_drained(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        queue = self._streams.get(rid)
        if queue is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            queue = streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # -- the subclass's side ---------------------------------------------------------------------
    async def _prepare(self) -> None:
        """Work before a request is queued (ProcessEngine waits for its tokenizer here)."""

    def _submit(self, request: EngineRequest) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _check_engine(self) -> None:
        raise NotImplementedError
