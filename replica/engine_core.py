"""The engine core in a process of its own (vLLM V1's split, `engine_core="process"`).

The core process runs the scheduler, the model and sampling as a busy loop of steps and
nothing else; the replica's actor becomes its front (`ProcessEngine`): request intake and
checks, detokenization and stop strings, metrics, KV-event publishing and streaming through
Ray. The two talk over a Unix socket pair, one pickled tuple per message (no objects with
methods cross it: a step's outputs travel as plain tuples, `encode_outputs`):

  front -> core   ("add", rid, prompt_ids, params, arrival, priority)   ("abort", rid)
                  ("stop", [rid, ...])   a stop string ended these (the front found it)
                  ("call", call_id, op, arg)   threads | sleep | kv_publish | kv_snapshot | kv_stats
                  ("shutdown",)
  core -> front   ("ready", info) | ("failed", traceback)   once, after the engine is built
                  ("step", outputs, StepReport, num_free_blocks, num_request_states)
                  ("idle", SchedulerStats, num_free_blocks, num_request_states)   heartbeat
                  ("error", rid, exception)   a request the core could not take
                  ("reply", call_id, ok, value)   ("dead", traceback)

Lifetimes are tied both ways: the core exits when its socket reaches end-of-file or its parent
process changes (the actor died, even by SIGKILL, even mid-step); the front finds the core's
end-of-file or exit at once, ends every stream with EngineDeadError and fails its health check,
so Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

from replica.config import EngineConfig
from replica.engine import (
    EngineDeadError,
    OutputProcessor,
    StepReport,
    StreamingEngine,
    check_request,
)
from replica.request import RequestOutput, SamplingParams
from replica.startup import freeze_heap

logger = logging.getLogger(__name__)

IDLE_HEARTBEAT_S = 1.0  # an idle core says so this often (the front's liveness clock)
PARENT_POLL_S = 0.5  # how often the core checks that the process that started it lives
STEP_TRACE_ENV = "STEPSERVE_STEP_TRACE"  # a file: the core appends one JSON line per add and step


# -- the wire format of a step's outputs ------------------------------------------------------
def encode_outputs(outputs: Sequence[RequestOutput]) -> list[tuple]:
    """A step's outputs as plain tuples (token ids only: the front detokenizes)."""
    return [
        (
            o.request_id,
            o.new_token_ids,
            o.num_prompt_tokens,
            o.num_output_tokens,
            o.finish_reason,
            o.stop_reason,
            o.new_logprobs,
            o.num_cached_tokens,
            o.num_preemptions,
            o.prompt_logprobs,
        )
        for o in outputs
    ]


def decode_output(t: tuple) -> RequestOutput:
    return RequestOutput(
        request_id=t[0],
        new_token_ids=t[1],
        new_text="",
        num_prompt_tokens=t[2],
        num_output_tokens=t[3],
        finish_reason=t[4],
        stop_reason=t[5],
        new_logprobs=t[6],
        num_cached_tokens=t[7],
        num_preemptions=t[8],
        prompt_logprobs=t[9],
    )


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineDeadError(repr(exc))


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

    def __init__(self, engine, conn: Connection, kv_events: bool) -> None:
        from replica.kv_publisher import KVEventSealer

        self.engine = engine
        self.conn = conn
        self._send_lock = threading.Lock()  # the grammar thread sends errors too
        self._report: StepReport | None = None
        self._kv_batch = None
        # batches are sealed from the start (the table stays exact) and sent once the front's
        # publisher asks (kv_publish: a router reads this replica; kv_publisher.py)
        self.sealer = KVEventSealer(engine) if kv_events else None
        engine.step_listeners.append(self._on_step)
        self._grammar_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiling: set[str] = set()  # requests whose grammar is being compiled
        self._compiled: deque = deque()  # ... and those whose grammar is ready
        self._grammar_engine_tried = False  # imported once the core has idled a heartbeat
        self._busy_at = time.monotonic()  # when the core last had a request
        self._trace = None
        if trace := os.environ.get(STEP_TRACE_ENV):
            try:
                self._trace = open(trace, "a", buffering=1)
                engine.step_listeners.append(self._trace_step)
            except OSError as exc:
                logger.warning("%s=%s: no step trace: %s", STEP_TRACE_ENV, trace, exc)

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _on_step(self, engine, scheduler_output, outputs, step_time) -> None:
        self._report = StepReport.of(engine, scheduler_output, step_time)

    def _trace_step(self, engine, scheduler_output, outputs, step_time) -> None:
        """STEPSERVE_STEP_TRACE: when each step ended, how long it took and what it ran (per
        request: id, first position, tokens, draft tokens, prompt tokens)."""
        if self._trace is None:  # stopped by a failed write
            return
        rows = [
            [s.request_id, s.start, s.num_tokens, len(s.draft), s.request.num_prompt_tokens]
            for s in scheduler_output.scheduled
        ]
        line = {"ev": "step", "t": time.monotonic(), "dur": step_time, "reqs": rows}
        times = getattr(engine.runner, "step_times", None)
        if times is not None:
            line["forward"] = times.forward
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

    def _counts(self) -> tuple:
        return self.engine.num_free_blocks, self.engine.num_request_states

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            busy = engine.has_unfinished()
            wait = 0.0 if busy else (0.002 if self._compiling else IDLE_HEARTBEAT_S)
            if conn.poll(wait):
                while True:
                    if not self._handle(conn.recv()):
                        return
                    if not conn.poll(0):
                        break
            if not self._grammar_engine_tried:  # until then, no work in the step loop
                if engine.has_unfinished() or self._compiling:  # a request just added counts
                    self._busy_at = time.monotonic()
                elif time.monotonic() - self._busy_at >= IDLE_HEARTBEAT_S:
                    self._load_grammar_engine()
            while self._compiled:
                self._add(*self._compiled.popleft())
            if not engine.has_unfinished():
                engine.runner.check_health()
                self.send(("idle", engine.stats(), *self._counts()))
                continue
            outputs = engine.step()
            report = self._report
            if report is None:  # nothing was scheduled (every request waits on the KV cache)
                report = StepReport(time.monotonic(), 0.0, 0, [], [], engine.stats())
            report.kv_batch, self._kv_batch, self._report = self._kv_batch, None, None
            self.send(("step", encode_outputs(outputs), report, *self._counts()))

    def _handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            _, rid, ids, params, arrival, priority = message
            if self._trace is not None:
                self._write_trace(
                    {"ev": "add", "t": time.monotonic(), "rid": rid, "arrival": arrival}
                )
            if params.structured is not None:  # compiled beside the loop, not between steps
                self._compiling.add(rid)
                if self._grammar_pool is None:
                    self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
                        1, "grammar", initializer=_unpinned
                    )
                self._grammar_pool.submit(self._compile, rid, ids, params, arrival, priority)
            else:
                self._add(rid, ids, params, arrival, None, priority)
        elif kind == "abort":
            self._compiling.discard(message[1])
            self.engine.abort([message[1]])
        elif kind == "stop":
            self.engine.finish_stopped(message[1])
        elif kind == "call":
            _, call_id, op, arg = message
            try:
                self.send(("reply", call_id, True, self._call(op, arg)))
            except Exception as exc:
                self.send(("reply", call_id, False, _picklable(exc)))
        elif kind == "shutdown":
            return False
        return True

    def _load_grammar_engine(self) -> None:
        """Import xgrammar and build its compiler's view of the vocabulary (with torch loaded,
        ~0.5-0.6 s that holds the GIL) once the core has idled a heartbeat, not at the first
        constrained request, whose compile thread would pause every request running beside
        it. A request that arrives meanwhile waits for it, once."""
        self._grammar_engine_tried = True
        try:
            self.engine.structured.prepare()
        except Exception as exc:  # a constrained request reports it
            logger.warning("grammar engine not loaded: %s", exc)
            return
        freeze_heap()  # a late import of the serving process (replica/startup.py)

    def _compile(self, rid, ids, params, arrival, priority) -> None:
        try:
            compiled = self.engine.compile_grammar(params)
        except Exception as exc:
            self._compiling.discard(rid)
            self.send(("error", rid, _picklable(exc)))
            return
        self._compiled.append((rid, ids, params, arrival, compiled, priority))

    def _add(self, rid, ids, params, arrival, compiled, priority) -> None:
        if compiled is not None:
            if rid not in self._compiling:
                return  # aborted while its grammar compiled
            self._compiling.discard(rid)
        try:
            self.engine.add_request(rid, ids, params, arrival, compiled, priority)
        except Exception as exc:  # the request's own problem: the front tells its caller
            self.send(("error", rid, _picklable(exc)))

    def _call(self, op: str, arg):
        if op == "threads":
            import torch

            torch.set_num_threads(int(arg))
            return torch.get_num_threads(), pin_compute_threads(self.engine.config)
        if op == "sleep":  # fault injection (the front checks that it is allowed)
            time.sleep(float(arg))
            return None
        if op == "kv_publish":
            if self.sealer is not None:
                self.sealer.sink = self._on_kv_batch if arg else None
            return None
        if op == "kv_snapshot":
            return self.sealer.log.snapshot() if self.sealer else None
        if op == "grammar_compiler_ready":
            return self.engine.structured.prepared
        if op == "kv_stats":
            return self.sealer.stats() if self.sealer else {}
        raise ValueError(f"unknown engine core call {op!r}")


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:  # re-parented: the replica's process is gone
            os._exit(0)


def _exit_with_process(pidfd: int) -> None:
    """Exit when the process behind `pidfd` does (a pre-started core's adopting front, which is
    not its parent: Linux's pidfd becomes readable when that process exits)."""
    while True:
        readable, _, _ = select.select([pidfd], [], [], PARENT_POLL_S)
        if readable:
            os._exit(0)


def _ready_info(engine, config: EngineConfig, prestarted: bool) -> dict:
    import torch

    return {
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "num_kv_blocks": engine.num_kv_blocks,
        "num_free_blocks": engine.num_free_blocks,
        "model_dir": str(engine.model_dir),
        "startup_s": engine.startup_s,
        "stats": engine.stats(),
        "num_threads": torch.get_num_threads(),
        "device": config.resolved_device(),
        "prestarted": prestarted,
    }


def _build(config_json: dict, num_threads: int | None):
    import torch

    from replica.engine import Engine

    config = EngineConfig.model_validate(config_json)
    if num_threads:
        torch.set_num_threads(num_threads)
    return config, Engine(config, detokenize=False)


def _serve(engine, conn: Connection, kv_events: bool, info: dict) -> None:
    """Tell the front the engine is ready, then step until it leaves; exits the process."""
    try:
        info = info | {"thread_cpus": pin_compute_threads(engine.config)}
        core = EngineCore(engine, conn, kv_events)
        freeze_heap()  # started: torch, the model, the kernels (replica/startup.py)
        conn.send(("ready", info))
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
            core.send(("dead", traceback.format_exc()))
        except Exception:
            pass
        code = 1
    try:
        engine.shutdown()
    finally:
        os._exit(code)


def main() -> None:
    """Entry of the core process: argv = [fd of its socket end, pid of the front], or
    ["--prestarted", fd of its listening socket, its path, pid of `stepserve serve`]."""
    logging.basicConfig(level=logging.WARNING, format="[engine core] %(levelname)s %(message)s")
    if sys.argv[1] == "--prestarted":
        _prestarted_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(
        target=_exit_with_parent, args=(parent_pid,), name="parent-watch", daemon=True
    ).start()
    conn = Connection(fd)
    try:
        _, config_json, kv_events, num_threads = conn.recv()
        config, engine = _build(config_json, num_threads)
    except EOFError:
        os._exit(0)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        os._exit(1)
    _serve(engine, conn, kv_events, _ready_info(engine, config, prestarted=False))


# -- a core started before the replica that adopts it (one machine, `stepserve serve`) ----------
PRESTARTED_CORE_ENV = "STEPSERVE_PRESTARTED_CORE"  # its socket's path, for the replicas
PRESTART_ADOPT_TIMEOUT_S = 600.0  # unadopted this long after its engine is built: it exits


def _peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def _prestarted_main(listener_fd: int, path: str, cli_pid: int) -> None:
    """A core `stepserve serve` starts before Ray (PrestartedCore): it builds the engine from the
    application's config (stdin) while Ray and Serve start, then waits on a Unix socket for one
    replica's front to adopt it. It lives with `stepserve serve` until adopted, then with the
    front (its socket's end-of-file, or the front's pid), as a core the front spawned does."""
    watch = threading.Thread(
        target=_exit_with_parent, args=(cli_pid,), name="parent-watch", daemon=True
    )
    watch.start()
    listener = socket.socket(fileno=listener_fd)  # bound and listening since PrestartedCore

    def forget_socket() -> None:  # its private directory too (PrestartedCore made both)
        for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
            try:
                remove(target)
            except OSError:
                pass

    def gone(code: int) -> None:
        forget_socket()
        os._exit(code)

    try:
        config_json, num_threads = json.loads(sys.stdin.read())
        config = EngineConfig.model_validate(config_json)
        if config.device == "auto" and config.resolved_device() != "cpu":
            gone(0)  # a GPU replica's devices are Ray's to assign: its front starts its own core
        config, engine = _build(config_json, num_threads)
    except BaseException:  # the adopting front finds no socket and starts its own core, which
        logger.exception("pre-started engine core failed; replicas start their own")  # says why
        gone(1)
    listener.settimeout(PRESTART_ADOPT_TIMEOUT_S)
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:  # timed out: no replica came
            gone(0)
        front_pid, uid = _peer_pid_uid(sock)
        if uid == os.getuid():
            break
        sock.close()
    forget_socket()  # one adoption: later replicas start cores of their own
    listener.close()
    sock.settimeout(None)
    try:
        pidfd = os.pidfd_open(front_pid)
    except OSError:
        os._exit(0)  # the front is already gone
    threading.Thread(
        target=_exit_with_process, args=(pidfd,), name="front-watch", daemon=True
    ).start()
    conn = Connection(sock.detach())
    try:
        conn.send(("adopted", os.getpid()))
        _, adopt_json, kv_events, adopt_threads = conn.recv()
        if adopt_json != config.model_dump(mode="json"):  # not the config it guessed: rebuild
            logger.warning("the adopting replica's engine config differs: building it anew")
            engine.shutdown()
            del engine
            config, engine = _build(adopt_json, adopt_threads)
        elif adopt_threads:
            import torch

            torch.set_num_threads(adopt_threads)
    except (EOFError, OSError):
        os._exit(0)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        os._exit(1)
    _serve(engine, conn, kv_events, _ready_info(engine, config, prestarted=True))


class PrestartedCore:
    """An engine core `stepserve serve` starts before Ray on its own machine, so that importing
    torch and building the engine (loading, packing, KV cache: seconds of CPU) overlap Ray's and
    Serve's start instead of following the replica's. The first replica whose front finds its
    socket (PRESTARTED_CORE_ENV, inherited by Ray's processes) adopts it; every other replica,
    and any replica after a failure, starts its own core as usual."""

    def __init__(self, config: EngineConfig, num_threads: int | None) -> None:
        self.dir = tempfile.mkdtemp(prefix="stepserve-core-")  # mode 0700: this user's only
        self.path = os.path.join(self.dir, "core.sock")
        # bound here, so a replica that comes before the core has started Python finds it
        # (and waits in its queue for the engine)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(8)
        fd = listener.fileno()
        argv, env = _core_command("--prestarted", str(fd), self.path, str(os.getpid()))
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, pass_fds=(fd,))
        listener.close()
        try:
            self.proc.stdin.write(
                json.dumps([config.model_dump(mode="json"), num_threads]).encode()
            )
            self.proc.stdin.close()
        except BrokenPipeError:  # it died at once: replicas start their own cores
            pass
        # reaped when it exits (adopted or not, it dies with its front or with this process)
        threading.Thread(target=self.proc.wait, name="prestarted-core", daemon=True).start()

    @property
    def env(self) -> dict[str, str]:
        return {PRESTARTED_CORE_ENV: self.path}

    def close(self, timeout: float = 5.0) -> None:
        """Unadopted: ended now. Adopted: its front has gone (Serve shut down), so it is
        exiting; waited for briefly, then ended."""
        adopted = not os.path.exists(self.path)
        try:
            self.proc.wait(timeout=timeout if adopted else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _core_command(*args: str) -> tuple[list[str], dict]:
    root = str(Path(__file__).resolve().parents[1])  # the repository, for `import replica`
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return [sys.executable, "-c", "from replica.engine_core import main; main()", *args], env


class _AdoptedProcess:
    """The Popen-like handle of a pre-started core: not this process's child, so it is watched
    through a pidfd and its exit code is not known."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> str | None:
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return "unknown (a pre-started core)" if readable else None

    def wait(self, timeout: float | None = None) -> str:
        readable, _, _ = select.select([self._pidfd], [], [], timeout)
        if not readable:
            raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout)
        return "unknown (a pre-started core)"

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _connect_prestarted() -> socket.socket | None:
    """A pre-started core's socket, connected; None when there is none to adopt (not set,
    already adopted, or it failed). (Its SO_PEERCRED pid is the process that bound the socket,
    `stepserve serve`, not the core: the core sends its own.)"""
    path = os.environ.get(PRESTARTED_CORE_ENV)
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        _, uid = _peer_pid_uid(sock)
        if uid != os.getuid():
            raise OSError(f"the socket's owner is uid {uid}")
        return sock
    except OSError:
        sock.close()
        return None


# -- the front (in the replica's actor) --------------------------------------------------------
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
        init = ("init", config.model_dump(mode="json"), kv_events, num_threads)
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
        if adopted and message[0] != "ready":  # it failed, or another replica took it first
            logger.warning("pre-started engine core not adopted (%s): starting one", message[1])
            self._conn.close()
            self._spawn_core(init)
            message = self._receive_ready()
        if message[0] != "ready":
            if self._proc is not None:
                self._proc.kill()
            raise RuntimeError(f"engine core process did not start: {message[1]}")
        info = message[1]
        self.engine = SimpleNamespace(  # what the replica reads of its engine
            model_dir=Path(info["model_dir"]),
            max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            num_kv_blocks=info["num_kv_blocks"],
            num_free_blocks=info["num_free_blocks"],
            num_request_states=0,
            startup_s={  # core_adopted: the wait for a pre-started core (PrestartedCore)
                **info["startup_s"],
                ("core_adopted" if info["prestarted"] else "core_process"): round(
                    time.perf_counter() - started, 3
                ),
            },
        )
        self._stats = info["stats"]
        self.num_threads = info["num_threads"]
        self.thread_cpus = info["thread_cpus"]  # pinned or not (pin_compute_threads)
        self.device = info["device"]
        self.pid = self._proc.pid
        logger.info(
            "engine core pid %d: %d torch threads, %s", self.pid, self.num_threads, self.thread_cpus
        )
        self._progress_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    def _spawn_core(self, init: tuple) -> None:
        front, core = socket.socketpair()
        argv, env = _core_command(str(core.fileno()), str(os.getpid()))
        self._proc = subprocess.Popen(argv, pass_fds=(core.fileno(),), env=env)
        core.close()
        self._conn = Connection(front.detach())
        self._send(init)

    def _adopt_core(self, init: tuple) -> bool:
        found = _connect_prestarted()
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

    def _receive_ready(self) -> tuple:
        try:
            message = self._conn.recv()
            if message[0] == "adopted":  # a pre-started core took this front: ("adopted", pid)
                self._proc = _AdoptedProcess(message[1])
                message = self._conn.recv()
            return message
        except (EOFError, OSError) as exc:
            if not isinstance(self._proc, subprocess.Popen):  # may live on, another's core
                return ("failed", f"the pre-started core closed the connection ({exc!r})")
            return ("failed", f"exited with code {self._proc.wait()}")

    # -- the stream side's hooks (StreamingEngine) ---------------------------------------------
    def _check_request(self, prompt_token_ids, params: SamplingParams, priority: int) -> None:
        info = self.engine
        check_request(
            self.config, info.vocab_size, info.max_model_len, info.num_kv_blocks,
            prompt_token_ids, params, priority,
        )  # fmt: skip

    @property
    def tokenizer(self):
        """The front's tokenizer (waits for its load, which starts with the front)."""
        return self._tokenizer.get()

    async def _prepare(self, params: SamplingParams):
        await self._tokenizer.wait()  # loading only for a request in the replica's first second
        return None  # the core compiles grammars beside its loop

    def _submit(self, rid, prompt_token_ids, params, arrival_time, compiled, priority) -> None:
        self.processor.add(rid, prompt_token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._send(("add", rid, list(prompt_token_ids), params, arrival, priority))

    def abort(self, request_id: str) -> None:
        self.processor.drop(request_id)
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass  # the core is gone: nothing to abort

    def _check_engine(self) -> None:
        if not self._reader.is_alive() or self._proc.poll() is not None:
            raise EngineDeadError(
                f"engine core process {self._proc.pid} is not running (exit code "
                f"{self._proc.poll()})"
            )

    # -- calls to the core ----------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError as exc:  # the core is gone (its reader thread says why, if it can)
            raise self.error or EngineDeadError(f"engine core process unreachable: {exc}") from exc

    def call(self, op: str, arg=None) -> concurrent.futures.Future:
        """Run a named operation in the core between two steps; its result in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            if self.error is not None:
                raise self.error
            self._send(("call", call_id, op, arg))
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

        self.call("threads", num_threads).add_done_callback(applied)

    def inject_stall(self, seconds: float) -> concurrent.futures.Future:
        return self.call("sleep", seconds)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self._send(("shutdown",))
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
                message = self._conn.recv()
                self._progress_at = time.monotonic()
                kind = message[0]
                if kind == "step":
                    _, outputs, report, free, states = message
                    self._stats = report.stats
                    self.engine.num_free_blocks, self.engine.num_request_states = free, states
                    self._on_step(outputs, report)
                elif kind == "idle":
                    _, self._stats, free, states = message
                    self.engine.num_free_blocks, self.engine.num_request_states = free, states
                elif kind == "error":
                    self.processor.drop(message[1])
                    self._deliver_error(message[1], message[2])
                elif kind == "reply":
                    _, call_id, ok, value = message
                    future = self._calls.pop(call_id, None)
                    if future is not None:
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "dead":
                    reason = f"engine core loop died: {message[1]}"
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

    def _on_step(self, outputs: list[tuple], report: StepReport) -> None:
        final, stopped = [], []
        for t in outputs:
            out, stop = self.processor.process(decode_output(t))
            if out is None:
                continue  # ended here already (stop string, abort): the core learns of it next
            if stop:
                stopped.append(out.request_id)
            final.append(out)
        if stopped:
            self._send(("stop", stopped))
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
