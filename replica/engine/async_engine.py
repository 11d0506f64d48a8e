"""The engine stepped on a thread of the replica's own process (`engine_core="thread"`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque

from replica.engine.core import Engine
from replica.engine.driver import EngineDriver
from replica.engine.streaming import StreamingEngine
from replica.engine.wire import Abort, Add, EngineInfo
from replica.request import EngineDeadError, EngineRequest

logger = logging.getLogger(__name__)


class AsyncEngine(StreamingEngine):
    """Runs Engine.step in a background thread; each request gets an async stream of deltas.

    Only the engine thread touches the scheduler: commands are queued and applied at the top of
    the next step (EngineDriver, as the core process applies them). Each step's outputs reach
    the event loop in one callback.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(engine.config, loop)
        self.engine = engine
        self.info = EngineInfo(
            model_dir=str(engine.model_dir),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            num_kv_blocks=engine.num_kv_blocks,
            startup_s=engine.startup_s,
            weight_bytes=engine.weight_bytes,
            num_threads=0,
            device=engine.config.resolved_device(),
        )
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._driver = EngineDriver(engine, self._deliver_error, on_compiled=self._wake.set)
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="stepserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_free_blocks(self) -> int:
        return self.engine.num_free_blocks

    @property
    def num_request_states(self) -> int:
        return self.engine.num_request_states

    def _check_engine(self) -> None:
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        self.engine.runner.check_health()  # a tensor-parallel group fails here when a rank dies

    def set_num_threads(self, num_threads: int) -> None:
        """Torch intra-op threads for the engine's steps, applied before the next one. OpenMP
        keeps the count per thread, so only the engine thread itself can change its own."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._post(("threads", num_threads))

    def call_on_engine_thread(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two steps; its result in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, future))
        return future

    def inject_stall(self, seconds: float) -> concurrent.futures.Future:
        """Block the engine thread for `seconds` (fault injection), as a stuck forward would."""
        return self.call_on_engine_thread(lambda engine: time.sleep(seconds))

    def _submit(self, request: EngineRequest) -> None:
        self._post(Add(request))

    def abort(self, request_id: str) -> None:
        self._post(Abort(request_id))

    def _post(self, command) -> None:
        self._inbox.append(command)
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._driver.shutdown()
        self.engine.shutdown()

    # -- engine thread -------------------------------------------------------------------------
    def _apply_inbox(self) -> None:
        driver = self._driver
        while self._inbox:
            command = self._inbox.popleft()
            if driver.apply(command):
                continue
            if command[0] == "call":
                _, fn, future = command
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)
            elif command[0] == "threads":
                import torch

                torch.set_num_threads(command[1])
                self.num_threads = torch.get_num_threads()
        driver.admit_compiled()

    def _run(self) -> None:
        import torch

        engine = self.engine
        self.num_threads = torch.get_num_threads()
        try:
            while not self._stopped:
                self._apply_inbox()
                if not engine.has_unfinished():
                    self._stats = engine.stats()
                    self._progress_at = time.monotonic()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self._progress_at = time.monotonic()
                self._stats = engine.stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:  # the loop is dead: every waiting caller must hear of it
            logger.exception("engine loop died")
            self.error = exc
            dead = EngineDeadError(f"engine loop died: {exc!r}")
            for rid in list(self._streams):
                self._deliver_error(rid, dead)
