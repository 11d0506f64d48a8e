"""The replica's side of an engine core in a process of its own (engine/core_process.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import socket
import subprocess
import threading
import time
import traceback
from multiprocessing.connection import Connection

from replica.config import EngineConfig
from replica.engine.core_process import core_command
from replica.engine.output_processor import OutputProcessor
from replica.engine.prestart import AdoptedProcess, connect_prestarted
from replica.engine.streaming import StreamingEngine
from replica.engine.wire import (
    Abort,
    Add,
    Adopted,
    Call,
    CoreOp,
    Dead,
    Failed,
    Idle,
    Init,
    Ready,
    Reply,
    RequestError,
    Shutdown,
    Step,
    StepReport,
    Stop,
    front_codec,
)
from replica.request import EngineDeadError, EngineRequest, RequestOutput
from replica.startup import freeze_heap

logger = logging.getLogger(__name__)


class ProcessEngine(StreamingEngine):
    """AsyncEngine's interface over an engine core in a process of its own: starts the process,
    detokenizes its outputs, streams them, and tells its steps to `report_listeners`
    (callables(StepReport, outputs): the replica's metrics)."""

    def __init__(
        self,
        config: EngineConfig,
        kv_events: bool = False,
        num_threads: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, loop)
        self.report_listeners: list = []
        self.kv_batch_listener = None  # callable(batch): the replica's KV-event publisher
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self.codec = front_codec()
        init = Init(config.model_dump(mode="json"), kv_events, num_threads)
        # the front's own tokenizer (detokenization) loads in a thread while the core starts
        # (or is adopted) and after: the replica is ready without waiting for it (~1 s, most of
        # it importing transformers); a request that comes before it has loaded waits for it
        # in _prepare
        from replica.tokenizer import LazyTokenizer

        self._tokenizer = LazyTokenizer(config.model_dir()).preload(then=freeze_heap)
        self.processor = OutputProcessor(self._tokenizer)
        started = time.perf_counter()
        adopted = self._adopt_core(init)
        if not adopted:
            self._spawn_core(init)
        message = self._receive_ready()
        if adopted and not isinstance(message, Ready):  # it failed, or another replica took it
            logger.warning("pre-started engine core not adopted (%s): starting one", message)
            self._conn.close()
            self._spawn_core(init)
            message = self._receive_ready()
        if not isinstance(message, Ready):
            if self._proc is not None:
                self._proc.kill()
            raise RuntimeError(f"engine core process did not start: {message.traceback}")
        info = message.info
        # core_adopted: the wait for a pre-started core (PrestartedCore)
        waited = "core_adopted" if info.prestarted else "core_process"
        info.startup_s = {**info.startup_s, waited: round(time.perf_counter() - started, 3)}
        self.info = info
        self.num_free_blocks, self.num_request_states = message.num_free_blocks, 0
        self._stats = message.stats
        self.num_threads = info.num_threads
        self.thread_cpus = info.thread_cpus  # pinned or not (pin_compute_threads)
        self.device = info.device
        self.pid = self._proc.pid
        logger.info(
            "engine core pid %d: %d torch threads, %s", self.pid, self.num_threads, self.thread_cpus
        )
        self._progress_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    def _spawn_core(self, init: Init) -> None:
        front, core = socket.socketpair()
        argv, env = core_command(str(core.fileno()), str(os.getpid()))
        self._proc = subprocess.Popen(argv, pass_fds=(core.fileno(),), env=env)
        core.close()
        self._conn = Connection(front.detach())
        self._send(init)

    def _adopt_core(self, init: Init) -> bool:
        found = connect_prestarted()
        if found is None:
            return False
        self._proc = None  # the core says its pid when it takes the connection
        self._conn = Connection(found.detach())
        try:
            self._send(init)
        except EngineDeadError:
            self._conn.close()
            return False
        return True

    def _receive_ready(self):
        try:
            message = self._receive()
            if isinstance(message, Adopted):  # a pre-started core took this front
                self._proc = AdoptedProcess(message.pid)
                message = self._receive()
            return message
        except (EOFError, OSError) as exc:
            if not isinstance(self._proc, subprocess.Popen):  # may live on, another's core
                return Failed(f"the pre-started core closed the connection ({exc!r})")
            return Failed(f"exited with code {self._proc.wait()}")

    def _receive(self):
        return self.codec.decode(self._conn.recv_bytes())

    # -- the stream side's hooks (StreamingEngine) ---------------------------------------------
    @property
    def tokenizer(self):
        """The front's tokenizer (waits for its load, which starts with the front)."""
        return self._tokenizer.get()

    async def _prepare(self) -> None:
        await self._tokenizer.wait()  # loading only for a request in the replica's first second

    def _submit(self, request: EngineRequest) -> None:
        self.processor.add(
            request.request_id, request.prompt_token_ids, request.sampling, request.resume
        )
        self._send(Add(request))

    def abort(self, request_id: str) -> None:
        self.processor.drop(request_id)
        try:
            self._send(Abort(request_id))
        except EngineDeadError:
            pass  # the core is gone: nothing to abort

    def _check_engine(self) -> None:
        if not self._reader.is_alive() or self._proc.poll() is not None:
            raise EngineDeadError(
                f"engine core process {self._proc.pid} is not running (exit code "
                f"{self._proc.poll()})"
            )

    # -- calls to the core ----------------------------------------------------------------------
    def _send(self, message) -> None:
        data = self.codec.encode(message)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as exc:  # the core is gone (its reader thread says why, if it can)
            raise self.error or EngineDeadError(f"engine core process unreachable: {exc}") from exc

    def call(
        self, op: CoreOp | str, arg=None, blob: bytes | None = None
    ) -> concurrent.futures.Future:
        """Run a named operation in the core between two steps; its result in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            op = CoreOp(op)
        except ValueError:
            names = ", ".join(o.value for o in CoreOp)
            future.set_exception(ValueError(f"unknown engine core call {op!r} (one of {names})"))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            if self.error is not None:
                raise self.error
            self._send(Call(call_id, op, arg, blob))
        except EngineDeadError as exc:
            self._calls.pop(call_id, None)
            future.set_exception(exc)
        return future

    def set_num_threads(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")

        def applied(future: concurrent.futures.Future) -> None:
            if future.exception() is None:
                self.num_threads, self.thread_cpus = future.result()

        self.call(CoreOp.THREADS, num_threads).add_done_callback(applied)

    def inject_stall(self, seconds: float) -> concurrent.futures.Future:
        return self.call(CoreOp.SLEEP, seconds)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._send(Shutdown())
        except EngineDeadError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

    # -- the reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        reason = None
        try:
            while True:
                message = self._receive()
                self._progress_at = time.monotonic()
                if isinstance(message, Step):
                    self._stats = message.report.stats
                    self.num_free_blocks = message.num_free_blocks
                    self.num_request_states = message.num_request_states
                    self._on_step(message.outputs, message.report)
                elif isinstance(message, Idle):
                    self._stats = message.stats
                    self.num_free_blocks = message.num_free_blocks
                    self.num_request_states = message.num_request_states
                elif isinstance(message, RequestError):
                    self.processor.drop(message.request_id)
                    self._deliver_error(message.request_id, message.error.load())
                elif isinstance(message, Reply):
                    future = self._calls.pop(message.call_id, None)
                    if future is not None:
                        value = message.value.load()
                        future.set_result(value) if message.ok else future.set_exception(value)
                elif isinstance(message, Dead):
                    reason = f"engine core loop died: {message.traceback}"
                    break
        except (EOFError, OSError):
            pass
        except BaseException:  # a bug of the front: the replica cannot serve on
            reason = f"engine core reader died: {traceback.format_exc()}"
        if self._stopped:
            return
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        reason = reason or f"engine core process {self._proc.pid} exited with code {code}"
        logger.error("%s", reason)
        self._fail(EngineDeadError(reason))

    def _on_step(self, outputs: list[RequestOutput], report: StepReport) -> None:
        final, stopped = [], []
        for output in outputs:
            out, stop = self.processor.process(output)
            if out is None:
                continue  # ended here already (stop string, abort): the core learns of it next
            if stop:
                stopped.append(out.request_id)
            final.append(out)
        if stopped:
            self._send(Stop(stopped))
        if report.kv_batch is not None and self.kv_batch_listener is not None:
            self.kv_batch_listener(report.kv_batch)
        for listener in self.report_listeners:
            listener(report, final)
        if final and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, final)

    def _fail(self, error: EngineDeadError) -> None:
        self.error = error
        for rid in list(self._streams):
            self._deliver_error(rid, error)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
