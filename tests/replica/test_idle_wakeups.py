"""An idle replica's background (issue 50): an unchanged exposition is not pushed every period,
and the engine core still ends with its parent (now watched on a pidfd). No Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import replica.deployment as deployment


class _Hub:
    def __init__(self) -> None:
        self.pushed: list[bytes] = []

        class _Push:
            @staticmethod
            def remote(replica_id: str, text: bytes) -> None:
                self.pushed.append(text)

        self.push = _Push()


class _Metrics:
    text = b"a 1\n"

    def exposition(self) -> bytes:
        return self.text


def test_unchanged_exposition_is_pushed_only_every_idle_period(monkeypatch):
    monkeypatch.setattr(deployment, "METRICS_PUSH_PERIOD_S", 0.01)
    monkeypatch.setattr(deployment, "METRICS_IDLE_PUSH_PERIOD_S", 0.3)
    server = deployment.LLMServer.__new__(deployment.LLMServer)
    server.hub, server.metrics, server.kv_events = _Hub(), _Metrics(), None
    server.replica_id, server._metrics_stop = "r", threading.Event()
    thread = threading.Thread(target=server._push_metrics, daemon=True)
    thread.start()
    time.sleep(0.2)  # ~20 periods, one push: the first
    assert server.hub.pushed == [b"a 1\n"]
    server.metrics.text = b"a 2\n"  # a change goes out at the next period
    time.sleep(0.1)
    assert server.hub.pushed == [b"a 1\n", b"a 2\n"]
    time.sleep(0.45)  # unchanged past the idle period: pushed again (the hub's freshness)
    server._metrics_stop.set()
    thread.join(timeout=5)
    assert server.hub.pushed[2:3] == [b"a 2\n"]
    assert len(server.hub.pushed) <= 4, server.hub.pushed


def test_core_exits_with_its_parent():
    # a parent (python -c) starts a child that watches it with exit_with_parent, prints its
    # pid, and the parent exits: the child must follow
    child = (
        "import os, sys, threading, time; from replica.engine.core_process import "
        "exit_with_parent; threading.Thread(target=exit_with_parent, args=(os.getppid(),), "
        "daemon=True).start(); print(os.getpid(), flush=True); time.sleep(60)"
    )
    parent = (
        f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
        "stdout=subprocess.PIPE, text=True); print(p.stdout.readline().strip(), flush=True)"
    )
    out = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=60,
        env=os.environ | {"PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the child outlived its parent")
