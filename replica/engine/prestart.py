"""A core `stepserve serve` starts before Ray on its own machine, adopted by the first replica
whose front finds its socket (PrestartedCore)."""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection

from replica.config import EngineConfig
from replica.engine.core_process import (
    build,
    core_command,
    exit_with_parent,
    exit_with_process,
    ready_message,
    receive_once,
    send_once,
    serve,
)
from replica.engine.wire import Adopted, Failed

logger = logging.getLogger(__name__)

PRESTARTED_CORE_ENV = "STEPSERVE_PRESTARTED_CORE"  # its socket's path, for the replicas
PRESTART_ADOPT_TIMEOUT_S = 600.0  # unadopted this long after its engine is built: it exits


def _peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def main() -> None:
    """Entry of a pre-started core: argv = [fd of its listening socket, its path, pid of
    `stepserve serve`]."""
    logging.basicConfig(level=logging.WARNING, format="[engine core] %(levelname)s %(message)s")
    prestarted_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))


def prestarted_main(listener_fd: int, path: str, cli_pid: int) -> None:
    """A core `stepserve serve` starts before Ray (PrestartedCore): it builds the engine from the
    application's config (stdin) while Ray and Serve start, then waits on a Unix socket for one
    replica's front to adopt it. It lives with `stepserve serve` until adopted, then with the
    front (its socket's end-of-file, or the front's pid), as a core the front spawned does."""
    watch = threading.Thread(
        target=exit_with_parent, args=(cli_pid,), name="parent-watch", daemon=True
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
        config, engine = build(config_json, num_threads)
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
        target=exit_with_process, args=(pidfd,), name="front-watch", daemon=True
    ).start()
    conn = Connection(sock.detach())
    try:
        send_once(conn, Adopted(os.getpid()))
        init = receive_once(conn)
        adopt_json, kv_events, adopt_threads = init.config, init.kv_events, init.num_threads
        if adopt_json != config.model_dump(mode="json"):  # not the config it guessed: rebuild
            logger.warning("the adopting replica's engine config differs: building it anew")
            engine.shutdown()
            del engine
            config, engine = build(adopt_json, adopt_threads)
        elif adopt_threads:
            import torch

            torch.set_num_threads(adopt_threads)
    except (EOFError, OSError):
        os._exit(0)
    except BaseException:
        send_once(conn, Failed(traceback.format_exc()))
        os._exit(1)
    serve(engine, conn, kv_events, ready_message(engine, config, prestarted=True))


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
        argv, env = core_command(str(fd), self.path, str(os.getpid()), module=__name__)
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


class AdoptedProcess:
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


def connect_prestarted() -> socket.socket | None:
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
