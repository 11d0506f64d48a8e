"""`stepserve serve` as a user runs it: embedded Ray, the default model, a real chat answer,
clean shutdown on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_default_model_answers_and_shuts_down(default_model_dir, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.time() + 240
        while "ready at" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "server did not become ready"
            time.sleep(1)
        assert f"http://127.0.0.1:{port}/v1" in log.read_text()
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
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()[-3000:]
    assert "shutting down" in log.read_text()
