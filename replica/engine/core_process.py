"""The engine core in a process of its own (vLLM V1's split, `engine_core="process"`).

The core process runs the scheduler, the model and sampling as a busy loop of steps and
nothing else; the replica's actor is its front (engine/core_client.py: request intake and
checks, detokenization and stop strings, metrics, KV-event publishing, streaming through Ray).
The two talk over a Unix socket pair in the typed messages of engine/wire.py.

Lifetimes are tied both ways: the core exits when its socket reaches end-of-file or its parent
process changes (the actor died, even by SIGKILL, even mid-step); the front finds the core's
end-of-file or exit at once, ends every stream with EngineDeadError and fails its health check,
so Serve replaces the replica.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from replica.config import EngineConfig
from replica.engine.core import Engine, step_report
from replica.engine.driver import EngineDriver
from replica.engine.wire import (
    Add,
    Call,
    CoreOp,
    Dead,
    EngineInfo,
    Failed,
    Idle,
    Init,
    Pickled,
    Ready,
    Reply,
    RequestError,
    Shutdown,
    Step,
    StepReport,
    core_codec,
)
from replica.startup import freeze_heap

logger = logging.getLogger(__name__)

IDLE_HEARTBEAT_S = 1.0  # an idle core says so this often (the front's liveness clock)
PARENT_POLL_S = 0.5  # how often the core checks that the process that started it lives
STEP_TRACE_ENV = "STEPSERVE_STEP_TRACE"  # a file: the core appends one JSON line per add and step


# -- the core process -----------------------------------------------------------------------------
# the CPUs the core process may use, read when the module loads: before any thread is pinned
PROCESS_CPUS: list[int] = (
    sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
)
_pinned_threads = 0  # how many torch threads pin_compute_threads pinned (0: none now)


def pin_compute_threads(config: EngineConfig) -> str:
    """Pin the core's torch threads one to a CPU (vLLM's worker pins its OpenMP threads the same
    way) when `cpu_pin_threads` is on, the engine runs on the CPU and its threads are as many as
    the CPUs this process may use: a replica that owns the host's cores, as `stepserve serve`'s
    does. On a host shared with the serving stack an unpinned pair can be stacked on one CPU
    while another process takes the other, and every parallel region waits. Otherwise every
    thread may run on all of them (a pin undone when the count changes). Returns what was
    done, for the ready report."""
    import torch

    from replica.layers.cpu_kernels import set_thread_cpus

    global _pinned_threads
    n = torch.get_num_threads()
    if config.resolved_device() != "cpu" or not PROCESS_CPUS:
        return "not pinned: not a CPU engine"
    if not config.cpu_pin_threads or n != len(PROCESS_CPUS):
        why = (
            "cpu_pin_threads off"
            if not config.cpu_pin_threads
            else (f"{n} threads, {len(PROCESS_CPUS)} CPUs")
        )
        if _pinned_threads:  # the team as large as when pinned: its idle threads too
            set_thread_cpus(PROCESS_CPUS, max(n, _pinned_threads), pin=False)
            _pinned_threads = 0
        return f"not pinned ({why})"
    done = set_thread_cpus(PROCESS_CPUS, n, pin=True)
    if done is None:
        return "not pinned (no native library with OpenMP)"
    if done != n:
        set_thread_cpus(PROCESS_CPUS, n, pin=False)
        _pinned_threads = 0
        return f"not pinned (sched_setaffinity refused for {n - done} of {n} threads)"
    _pinned_threads = n
    return f"pinned: thread i on CPU {PROCESS_CPUS}[i]"


def _unpinned() -> None:
    """A thread the core starts after pinning (it inherits its creator's one CPU) runs on all."""
    if PROCESS_CPUS:
        os.sched_setaffinity(0, PROCESS_CPUS)


class EngineCore:
    """The loop of the core process: apply the front's commands, step, send the step."""

    def __init__(self, engine: Engine, conn: Connection, kv_events: bool) -> None:
        from replica.kv_publisher import KVEventSealer

        self.engine = engine
        self.conn = conn
        self.codec = core_codec()
        self._send_lock = threading.Lock()  # the grammar thread sends errors too
        self._report: StepReport | None = None
        self._kv_batch = None
        # batches are sealed from the start (the table stays exact) and sent once the front's
        # publisher asks (kv_publish: a router reads this replica; kv_publisher.py)
        self.sealer = KVEventSealer(engine) if kv_events else None
        engine.step_listeners.append(self._on_step)
        self.driver = EngineDriver(engine, self._request_error, thread_initializer=_unpinned)
        self._grammar_engine_tried = False  # imported once the core has idled a heartbeat
        self._busy_at = time.monotonic()  # when the core last had a request
        # commands read during a step that wait for its end (`_arrivals`), in order
        self._deferred: list = []
        engine.poll_arrivals = self._arrivals  # used when the engine joins steps (step_join)
        self._trace = None
        self._pid = os.getpid()  # tells the replicas of one trace file apart
        if trace := os.environ.get(STEP_TRACE_ENV):
            try:
                self._trace = open(trace, "a", buffering=1)
                engine.step_listeners.append(self._trace_step)
            except OSError as exc:
                logger.warning("%s=%s: no step trace: %s", STEP_TRACE_ENV, trace, exc)

    def send(self, message) -> None:
        data = self.codec.encode(message)
        with self._send_lock:
            self.conn.send_bytes(data)

    def _request_error(self, request_id: str, exc: BaseException) -> None:
        self.send(RequestError(request_id, Pickled.of(exc)))

    def _on_step(self, engine, scheduler_output, outputs, step_time) -> None:
        self._report = step_report(engine, scheduler_output, step_time)

    def _trace_step(self, engine, scheduler_output, outputs, step_time) -> None:
        """STEPSERVE_STEP_TRACE: when each step ended, how long it took and what it ran (per
        request: id, first position, tokens, draft tokens, prompt tokens)."""
        if self._trace is None:  # stopped by a failed write
            return
        rows = [
            [s.request_id, s.start, s.num_tokens, len(s.draft), s.request.num_prompt_tokens]
            for s in scheduler_output.scheduled
        ]
        line = {"ev": "step", "pid": self._pid, "t": time.monotonic(), "dur": step_time,
                "reqs": rows}  # fmt: skip
        times = getattr(engine.runner, "step_times", None)  # ModelRunner's; not every Runner's
        if times is not None:
            line["forward"] = times.forward
        if engine.last_join is not None:  # prompts joined before this layer (step_join)
            line["join"] = engine.last_join
        self._write_trace(line)

    def _write_trace(self, line: dict) -> None:
        """One line, or none and no more tracing once the file cannot be written (a full disk
        ends the trace, not the engine)."""
        if self._trace is None:
            return
        try:
            self._trace.write(json.dumps(line) + "\n")
        except (OSError, ValueError) as exc:
            logger.warning("step trace stopped: %s", exc)
            self._trace = None

    def _on_kv_batch(self, batch) -> None:
        self._kv_batch = batch

    def run(self) -> None:
        engine, conn, driver, decode = self.engine, self.conn, self.driver, self.codec.decode
        while True:
            if self._deferred and not self.handle_deferred():
                return
            busy = engine.has_unfinished()
            wait = 0.0 if busy else (0.002 if driver.compiling else IDLE_HEARTBEAT_S)
            if conn.poll(wait):
                while True:
                    if not self._handle(decode(conn.recv_bytes())):
                        return
                    if not conn.poll(0):
                        break
            if not self._grammar_engine_tried:  # until then, no work in the step loop
                if engine.has_unfinished() or driver.compiling:  # a request just added counts
                    self._busy_at = time.monotonic()
                elif time.monotonic() - self._busy_at >= IDLE_HEARTBEAT_S:
                    self._load_grammar_engine()
            driver.admit_compiled()
            if not engine.has_unfinished():
                engine.runner.check_health()
                self.send(Idle(engine.stats(), engine.num_free_blocks, engine.num_request_states))
                continue
            outputs = engine.step()
            report = self._report
            if report is None:  # nothing was scheduled (every request waits on the KV cache)
                report = StepReport(time.monotonic(), 0.0, 0, [], [], engine.stats())
            report.kv_batch, self._kv_batch, self._report = self._kv_batch, None, None
            self.send(Step(outputs, report, engine.num_free_blocks, engine.num_request_states))

    def handle_deferred(self) -> bool:
        """The commands read during the last step that it did not take (`_arrivals`), in
        order; False on Shutdown."""
        deferred, self._deferred = self._deferred, []
        return all(self._handle(message) for message in deferred)

    def _arrivals(self) -> bool:
        """During a step (the engine's poll_arrivals): queue the plain requests that came
        (Add, no grammar, no adapter: nothing else touches the scheduler mid-step); the first
        other command, and all after it, wait for the step's end. True when one was queued."""
        added = False
        conn, decode = self.conn, self.codec.decode
        while not self._deferred and conn.poll(0):
            message = decode(conn.recv_bytes())
            if (
                isinstance(message, Add)
                and message.request.sampling.structured is None
                and message.request.lora is None
            ):
                self._handle(message)
                added = True
            else:
                self._deferred.append(message)
        return added

    def _handle(self, message) -> bool:
        if self._trace is not None and hasattr(message, "request"):  # an Add
            request = message.request
            self._write_trace(
                {
                    "ev": "add",
                    "pid": self._pid,
                    "t": time.monotonic(),
                    "rid": request.request_id,
                    "arrival": request.arrival_time,
                }
            )
        if self.driver.apply(message):
            return True
        if isinstance(message, Call):
            try:
                self.send(Reply(message.call_id, True, Pickled.of(self._call(message))))
            except Exception as exc:
                self.send(Reply(message.call_id, False, Pickled.of(exc)))
        elif isinstance(message, Shutdown):
            return False
        return True

    def _load_grammar_engine(self) -> None:
        """Load the tokenizer (engine.first_text watches with it from then on), import xgrammar
        and build its compiler's view of the vocabulary (with torch loaded, ~0.5-0.6 s that
        holds the GIL) once the core has idled a heartbeat, not at the first constrained
        request, whose compile thread would pause every request running beside it. A request
        that arrives meanwhile waits for it, once."""
        self._grammar_engine_tried = True
        try:
            self.engine.tokenizer  # noqa: B018 - loads it: the first-text watch reads it too
            self.engine.structured.prepare()
        except Exception as exc:  # a constrained request reports it
            logger.warning("grammar engine not loaded: %s", exc)
            return
        freeze_heap()  # a late import of the serving process (replica/startup.py)

    def _call(self, call: Call):
        op, arg = call.op, call.arg
        if op is CoreOp.THREADS:
            import torch

            torch.set_num_threads(int(arg))
            return torch.get_num_threads(), pin_compute_threads(self.engine.config)
        if op is CoreOp.SLEEP:  # fault injection (the front checks that it is allowed)
            time.sleep(float(arg))
            return None
        if op is CoreOp.KV_PUBLISH:
            if self.sealer is not None:
                self.sealer.sink = self._on_kv_batch if arg else None
            return None
        if op is CoreOp.KV_SNAPSHOT:
            return self.sealer.log.snapshot() if self.sealer else None
        if op is CoreOp.GRAMMAR_COMPILER_READY:
            return self.engine.structured.prepared
        if op is CoreOp.KV_STATS:
            return self.sealer.stats() if self.sealer else {}
        if op is CoreOp.LORA_ADD:
            name, path = arg
            return self.engine.add_lora(name, path)
        if op is CoreOp.LORA_REMOVE:
            return self.engine.remove_lora(arg)
        if op is CoreOp.LORA_LIST:
            return self.engine.list_loras()
        if op is CoreOp.KV_EXPORT:
            return self.engine.export_kv(pickle.loads(call.blob))
        if op is CoreOp.KV_IMPORT:
            return self.engine.import_kv(*pickle.loads(call.blob))
        if op is CoreOp.KV_MEASURE:
            from replica.kv_transfer import measure_engine

            return measure_engine(self.engine)
        raise ValueError(f"unknown engine core call {op!r}")


def exit_with_parent(parent_pid: int) -> None:
    """Exit when the process that started this one does: blocked on its pidfd (Linux >= 5.3:
    no wake-up until it exits), else polling for re-parenting every PARENT_POLL_S."""
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None and os.getppid() == parent_pid:  # still ours once the fd is held
        exit_with_process(pidfd)
    while True:
        if os.getppid() != parent_pid:  # re-parented: the replica's process is gone
            os._exit(0)
        time.sleep(PARENT_POLL_S)


def exit_with_process(pidfd: int) -> None:
    """Exit when the process behind `pidfd` does (a pre-started core's adopting front, which is
    not its parent: Linux's pidfd becomes readable when that process exits). Blocks without a
    timeout: an idle core's thread does not wake for it."""
    while True:
        readable, _, _ = select.select([pidfd], [], [])
        if readable:
            os._exit(0)


def ready_message(engine: Engine, config: EngineConfig, prestarted: bool) -> Ready:
    import torch

    info = EngineInfo(
        model_dir=str(engine.model_dir),
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        num_kv_blocks=engine.num_kv_blocks,
        startup_s=engine.startup_s,
        weight_bytes=engine.weight_bytes,
        num_threads=torch.get_num_threads(),
        device=config.resolved_device(),
        prestarted=prestarted,
    )
    return Ready(info, engine.stats(), engine.num_free_blocks)


def build(config_json: dict, num_threads: int | None) -> tuple[EngineConfig, Engine]:
    import torch

    config = EngineConfig.model_validate(config_json)
    if num_threads:
        torch.set_num_threads(num_threads)
    return config, Engine(config, detokenize=False)


def send_once(conn: Connection, message) -> None:
    """A message before the core's loop runs (its codec is the loop's)."""
    conn.send_bytes(core_codec().encode(message))


def receive_once(conn: Connection):
    return core_codec().decode(conn.recv_bytes())


def serve(engine: Engine, conn: Connection, kv_events: bool, ready: Ready) -> None:
    """Tell the front the engine is ready, then step until it leaves; exits the process."""
    try:
        ready.info.thread_cpus = pin_compute_threads(engine.config)
        core = EngineCore(engine, conn, kv_events)
        freeze_heap()  # started: torch, the model, the kernels (replica/startup.py)
        core.send(ready)
    except (EOFError, OSError):
        os._exit(0)
    code = 0
    try:
        core.run()
    except (EOFError, OSError):  # the front closed its end: it is gone
        pass
    except BaseException:
        logger.exception("engine core loop died")
        try:
            core.send(Dead(traceback.format_exc()))
        except Exception:
            pass
        code = 1
    try:
        core.driver.shutdown()
        engine.shutdown()
    finally:
        os._exit(code)


def main() -> None:
    """Entry of the core process: argv = [fd of its socket end, pid of the front]."""
    logging.basicConfig(level=logging.WARNING, format="[engine core] %(levelname)s %(message)s")
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(
        target=exit_with_parent, args=(parent_pid,), name="parent-watch", daemon=True
    ).start()
    conn = Connection(fd)
    try:
        init = receive_once(conn)
        assert isinstance(init, Init), f"the front's first message is {init!r}"
        config, engine = build(init.config, init.num_threads)
    except EOFError:
        os._exit(0)
    except BaseException:
        send_once(conn, Failed(traceback.format_exc()))
        os._exit(1)
    serve(engine, conn, init.kv_events, ready_message(engine, config, prestarted=False))


def core_command(*args: str, module: str = __name__) -> tuple[list[str], dict]:
    """The command line and environment that start a core process (`module`'s main)."""
    root = str(Path(__file__).resolve().parents[2])  # the repository, for `import replica`
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-c", f"from {module} import main; main()", *args]
    return argv, env
