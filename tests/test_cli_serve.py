"""`stepserve serve` as a user runs it: embedded Ray, the default model, a real chat answer,
a SIGTERM that lets an in-flight stream finish before the process exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.ray


def _process_commands() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return out


def test_serve_default_model_answers_and_shuts_down(default_model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 240
        while "ready at" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "server did not become ready"
            time.sleep(1)
        assert f"http://127.0.0.1:{port}/v1" in log.read_text()
        # HAProxy, not Ray's Python proxy, listens on the port
        assert any("haproxy" in cmd for cmd in _process_commands()), "no HAProxy process"
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 32,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        # SIGTERM while a stream runs: the stream still ends normally (the app drains first)
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 64,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        events = []
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["text"] for c in chunks)) > 0
        code = proc.wait(timeout=120)
        drain_s = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    assert code == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "draining in-flight requests" in text and "shutting down" in text
    # the embedded cluster runs Ray Serve's throughput-optimized mode, HAProxy in front of the
    # ingress replicas (the requests above went through it: Ray's Python proxy is not there)
    assert "Throughput optimized Ray Serve enabled" in text, text[-3000:]
    assert "Direct ingress enabled" in text, text[-3000:]
    # the SIGTERM drain does not wait out the 30 s meant for external load balancers
    assert drain_s < 25, drain_s
