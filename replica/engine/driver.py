"""What both serving transports do to an Engine on the thread that steps it: take requests in,
compile a structured request's grammar beside the loop (not between steps), abort, end the
requests a stop string finished. AsyncEngine's thread and the core process's loop each own one
EngineDriver and call it between steps."""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable, Sequence

from replica.engine.core import Engine
from replica.engine.wire import Abort, Add, Stop
from replica.request import EngineRequest


class EngineDriver:
    """`on_error(request_id, exc)`: a request the engine could not take (its grammar failed
    to compile, or the engine refused it); `on_compiled()`: a grammar is ready (the stepping
    thread should wake to `admit_compiled`)."""

    def __init__(
        self,
        engine: Engine,
        on_error: Callable[[str, BaseException], None],
        on_compiled: Callable[[], None] | None = None,
        thread_initializer: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_error = on_error
        self._on_compiled = on_compiled
        self._initializer = thread_initializer
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiling: set[str] = set()  # requests whose grammar is being compiled
        self._compiled: deque = deque()  # (request, compiled grammar) ready to join

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def apply(self, message) -> bool:
        """Apply a request command (Add, Abort, Stop); False for any other message (the
        transport's own: calls, shutdown)."""
        if isinstance(message, Add):
            self.add(message.request)
        elif isinstance(message, Abort):
            self.abort(message.request_id)
        elif isinstance(message, Stop):
            self.stop(message.request_ids)
        else:
            return False
        return True

    def add(self, request: EngineRequest) -> None:
        if request.sampling.structured is None:
            self._add(request, None)
            return
        self._compiling.add(request.request_id)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, "grammar", initializer=self._initializer
            )
        self._pool.submit(self._compile, request)

    def abort(self, request_id: str) -> None:
        self._compiling.discard(request_id)  # one still compiling is dropped when it is ready
        self.engine.abort([request_id])

    def stop(self, request_ids: Sequence[str]) -> None:
        """End requests whose stop string the front found."""
        self.engine.finish_stopped(request_ids)

    def admit_compiled(self) -> None:
        """Queue the requests whose grammar compiled since the last call; report the requests
        the engine ended on an error since then (an adapter that failed to load)."""
        for request_id, exc in self.engine.take_request_errors():
            self._on_error(request_id, exc)
        while self._compiled:
            request, compiled = self._compiled.popleft()
            if request.request_id not in self._compiling:
                continue  # aborted while its grammar compiled
            self._compiling.discard(request.request_id)
            self._add(request, compiled)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, request: EngineRequest) -> None:
        try:
            compiled = self.engine.compile_grammar(request.sampling)
        except Exception as exc:
            if request.request_id in self._compiling:
                self._compiling.discard(request.request_id)
                self._on_error(request.request_id, exc)
            return
        self._compiled.append((request, compiled))
        if self._on_compiled is not None:
            self._on_compiled()

    def _add(self, request: EngineRequest, compiled) -> None:
        try:
            self.engine.add(request, compiled)
        except Exception as exc:  # the request's own problem: its caller hears of it
            self._on_error(request.request_id, exc)
