"""`stepserve serve` as a user runs it: embedded Ray, the default model, a real chat answer,
a kill -9 that leaves the port free, a SIGTERM that lets an in-flight stream finish before the
process exits."""

from __future__ import annotations

import json
import os
import re
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


def _environ_of(title: str) -> dict[str, str]:
    """The environment of the process whose command line contains `title`."""
    for pid in os.listdir("/proc"):
        try:
            if title in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                raw = Path(f"/proc/{pid}/environ").read_bytes()
                return dict(
                    item.decode(errors="replace").split("=", 1)
                    for item in raw.split(b"\0")
                    if b"=" in item
                )
        except OSError:
            continue
    raise AssertionError(f"no process {title!r}")


def _listening_pids(port: int) -> list[int]:
    from cluster.processes import find_listeners

    return [listener.pid for listener in find_listeners(port)]


def _start_serve(port: int, log: Path, *extra: str, env_extra: dict | None = None):
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env.update(env_extra or {})
    with open(log, "w") as out:
        # a session of its own: the test kills the whole group, as a crash or OOM kill would
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while "ready at" not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "server did not become ready: " + log.read_text()[-3000:]
        time.sleep(1)


def _answer(port: int) -> str:
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_serve_survives_sigkill_then_answers_and_drains_on_sigterm(default_model_dir, tmp_path):
    """A user's server over its life, in one test (each start of the default model costs
    ~25 s): kill -9 of the first server's whole process group (a crash, an OOM kill) leaves
    nothing on its port (HAProxy dies with its Ray actor); a second server on the same port
    comes up, runs HAProxy in front of the ingress, answers a chat from the default model, and
    on SIGTERM lets an in-flight stream finish before it exits 0."""
    port = free_port()
    # the first server pre-starts its engine core (opt-in), the second does not
    proc = _start_serve(port, tmp_path / "first.log", env_extra={"STEPSERVE_PRESTART_CORE": "1"})
    try:
        _wait_ready(proc, tmp_path / "first.log")
        first = _answer(port)
        # the start-up report: this process's phases and the replica's engine phases
        report = re.search(
            r"ready ([\d.]+) s after start \(ray [\d.]+ s, serve [\d.]+ s, application "
            r"([\d.]+) s\); an LLM replica: process boot and imports [\d.]+ s, engine ([\d.]+) s "
            r"\(tokenizer [\d.]+, config [\d.]+, weights [\d.]+, kernels [\d.]+, kv_cache",
            (tmp_path / "first.log").read_text(),
        )
        assert report, (tmp_path / "first.log").read_text()[-3000:]
        ready_s, application_s, engine_s = map(float, report.groups())
        # the engine phase of an adopted core is the wait for it: 0.0 s once it is built
        assert 0 <= engine_s < application_s < ready_s
        # the replica adopted the engine core `stepserve serve` started before Ray
        assert re.search(r"core_adopted [\d.]+\)", (tmp_path / "first.log").read_text())
        holders = _listening_pids(port)
        assert holders, "nothing listens on the serving port"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.time() + 60
    while _listening_pids(port):
        assert time.time() < deadline, f"port {port} still held by {_listening_pids(port)}"
        time.sleep(0.5)
    log = tmp_path / "second.log"
    # Ray Serve's throughput-optimized mode in this process's own environment too (as the
    # benches set it): the start-up report's blocking handle call still reads the replica
    proc = _start_serve(port, log, env_extra={"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"})
    try:
        _wait_ready(proc, log)
        assert _answer(port) == first  # the same answer from a core its replica spawned
        assert f"http://127.0.0.1:{port}/v1" in log.read_text()
        assert re.search(r"core_process [\d.]+\)", log.read_text()), log.read_text()[-3000:]
        # HAProxy, not Ray's Python proxy, listens on the port
        assert any("haproxy" in cmd for cmd in _process_commands()), "no HAProxy process"
        # the ingress replicas drain for 1 s, not the 30 s meant for external load balancers
        ingress_env = _environ_of("ServeReplica:stepserve:Ingress")
        assert ingress_env.get("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S") == "1"
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                # the served default is the Q4_1 file with int8 activations: to "What is the
                # capital of France?" it (and llama.cpp on the same file) answers in French
                # without the name; this wording it answers
                "messages": [{"role": "user", "content": "Name the capital of France."}],
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
        stream_end = time.monotonic()
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["text"] for c in chunks)) > 0
        assert stream_end > signalled
        code = proc.wait(timeout=120)
        drain_s = time.monotonic() - stream_end
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
    assert code == 0, log.read_text()[-3000:]
    # no engine core outlives its server (the first one's went with its process group)
    deadline = time.time() + 20
    while any("--prestarted" in cmd for cmd in _process_commands()):
        assert time.time() < deadline, "a pre-started engine core outlived its server"
        time.sleep(0.5)
    text = log.read_text()
    assert "draining in-flight requests" in text and "shutting down" in text
    # the embedded cluster runs Ray Serve's throughput-optimized mode, HAProxy in front of the
    # ingress replicas (the requests above went through it: Ray's Python proxy is not there)
    assert "Throughput optimized Ray Serve enabled" in text, text[-3000:]
    assert "Direct ingress enabled" in text, text[-3000:]
    # after the last stream ends, the shutdown does not wait out the 30 s meant for external
    # load balancers (35 s from the SIGTERM was seen on a host with both cores loaded, the
    # stream's own decoding included)
    assert drain_s < 30, drain_s


def test_a_taken_port_is_a_clear_error_naming_its_holder(tmp_path):
    """Before Ray starts: the port and the process holding it, exit code 2."""
    import socket

    port = free_port()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
            "print('ok', flush=True); time.sleep(120)",
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ok"
        with socket.socket() as probe:  # the port really is taken
            assert probe.connect_ex(("127.0.0.1", port)) == 0
        log = tmp_path / "serve.log"
        proc = _start_serve(port, log, "--host", "127.0.0.1")
        code = proc.wait(timeout=120)
        text = log.read_text()
        assert code == 2, text
        assert f"port {port} on 127.0.0.1 is already in use by pid {holder.pid}" in text, text
        assert "--port" in text
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_haproxy_of_an_earlier_server_is_ended_with_a_log_line(tmp_path):
    """A stale HAProxy (as one left by a crashed server before HAProxy was tied to its parent:
    a Ray session's config, no Ray actor above it) holding the port is ended at start-up, with
    a line saying so; the port is then free."""
    from cluster.processes import check_port_free, real_haproxy_binary

    binary = real_haproxy_binary({})
    if binary is None:
        pytest.skip("no HAProxy binary")
    port = free_port()
    session = tmp_path / "session_2026-01-01_00-00-00_000000_1"
    session.mkdir()
    config = session / "haproxy.cfg"
    config.write_text(
        "global\n  maxconn 16\ndefaults\n  mode http\n  timeout connect 1s\n"
        "  timeout client 5s\n  timeout server 5s\n"
        f"frontend f\n  bind 127.0.0.1:{port}\n  http-request return status 200\n"
    )
    stale = subprocess.Popen([binary, "-db", "-f", str(config)], stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while stale.pid not in _listening_pids(port):
            assert stale.poll() is None, stale.stderr.read()
            assert time.time() < deadline, "haproxy did not listen"
            time.sleep(0.1)
        check_port_free("127.0.0.1", port)
        assert stale.wait(timeout=10) == -signal.SIGKILL
        assert not _listening_pids(port)
    finally:
        if stale.poll() is None:
            stale.kill()
            stale.wait()


# Run in a process of its own: ray.init as `stepserve serve` calls it when another cluster is
# discoverable (first with no address, to show that it is, then through the embedded start
# path, all but the deployment), printing what it joined.
_EMBEDDED_BESIDE_ANOTHER = """
import json, os, sys
import ray
try:
    ray.init(num_cpus=1, logging_level="ERROR")  # what `serve` did: join the latest cluster
    joined = "connected to " + ray.get_runtime_context().gcs_address
    ray.shutdown()
except ValueError as exc:
    joined = str(exc)
from cluster import embedded
from cluster.config import ClusterConfig
embedded._deploy = lambda config, timings: "not deployed"  # the Ray part of start() only
config = ClusterConfig.model_validate({"http": {"host": "127.0.0.1", "port": int(sys.argv[1])}})
embedded.start(config)
print(json.dumps({
    "plain_init": joined,
    "gcs_address": ray.get_runtime_context().gcs_address,
    "cpus": ray.cluster_resources().get("CPU"),
    "nodes": len(ray.nodes()),
}), flush=True)
ray.shutdown()
"""


def _end_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """End the process group of `proc` (started in a session of its own): SIGTERM, up to
    `grace_s` for the group to exit, then SIGKILL for what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    while time.time() < deadline:
        if proc.poll() is not None:
            try:
                os.killpg(proc.pid, 0)  # any member left?
            except ProcessLookupError:
                return
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def test_serve_starts_its_own_cluster_beside_a_running_ray_start_cluster():
    """With a `ray start` cluster on the machine (RAY_ADDRESS unset), ray.init with no address
    joins it and refuses num_cpus ("When connecting to an existing cluster, num_cpus and
    num_gpus must not be provided"); the embedded start path starts a cluster of its own, with
    this machine's CPUs, and leaves the other one be."""
    import shutil
    import tempfile

    # a Ray temp dir of this test's own (short: Ray's socket paths must fit 107 bytes), so the
    # cluster it starts is the one found, not another test's on the same host
    ray_tmp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_"))}
    env["RAY_TMPDIR"] = ray_tmp
    head_port = free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head_cmd = [
        ray_bin, "start", "--head", "--block", "--port", str(head_port), "--num-cpus", "1",
        "--include-dashboard", "false", "--dashboard-agent-listen-port", str(free_port()),
        "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats",
    ]  # fmt: skip
    head = subprocess.Popen(
        head_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    embedded = None
    try:
        address_file = Path(ray_tmp, "ray", "ray_current_cluster")
        deadline = time.time() + 120
        while not address_file.exists():
            assert head.poll() is None, head.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "ray start did not come up"
            time.sleep(0.5)
        other = address_file.read_text().strip()
        assert other.endswith(f":{head_port}"), other
        embedded = subprocess.Popen(
            [sys.executable, "-c", _EMBEDDED_BESIDE_ANOTHER, str(free_port())],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        out, err = embedded.communicate(timeout=240)
        assert embedded.returncode == 0, err[-3000:]
        seen = json.loads(out.strip().splitlines()[-1])
        # the setup reproduces the trouble: a plain ray.init finds the `ray start` cluster
        assert "num_cpus and num_gpus must not be provided" in seen["plain_init"], seen
        # the embedded start made a cluster of its own (one node, this machine's CPUs)
        assert not seen["gcs_address"].endswith(f":{head_port}"), seen
        assert (seen["cpus"], seen["nodes"]) == (os.cpu_count(), 1), seen
        assert head.poll() is None, "the `ray start` cluster went down"
    finally:
        if embedded is not None:
            _end_group(embedded)
        _end_group(head)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _ray_start_head(ray_tmp: str, port: int, env: dict) -> subprocess.Popen:
    """`ray start --head --block` on `port` with a Ray temp dir of its own, in a session of its
    own (ended with _end_group), once its address file is written."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cmd = [
        ray_bin, "start", "--head", "--block", "--port", str(port), "--num-cpus", "0",
        "--include-dashboard", "false", "--dashboard-agent-listen-port", str(free_port()),
        "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats",
    ]  # fmt: skip
    head = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    address_file = Path(ray_tmp, "ray", "ray_current_cluster")
    deadline = time.time() + 120
    while not address_file.exists():
        assert head.poll() is None, head.stdout.read()[-3000:]
        assert time.time() < deadline, "ray start did not come up"
        time.sleep(0.5)
    return head


def test_joining_a_cluster_that_wants_a_token_fails_fast_saying_what_to_do(
    tiny_llama_dir, tmp_path
):
    """Ray 2.60: a head started where a token file exists (as one an earlier embedded
    `stepserve serve` wrote to ~/.ray/auth_token) requires the token. `stepserve serve
    --address` without it, or with another one, exits 2 within seconds with a `stepserve:
    error:` line naming the address and the variables to set, not ray.init's ConnectionError
    after 20 s; with the right token the probe lets it through."""
    import shutil
    import tempfile

    from replica.cache import cache_root

    token = "0123456789abcdef0123456789abcdef"
    head_home, other_home = tmp_path / "head-home", tmp_path / "other-home"
    (head_home / ".ray").mkdir(parents=True)
    (head_home / ".ray" / "auth_token").write_text(token)
    other_home.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # short: Ray's socket paths
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_", "RAY_AUTH_"))
    }
    base |= {"RAY_TMPDIR": ray_tmp, "STEPSERVE_CACHE": str(cache_root())}
    port = free_port()
    head = _ray_start_head(ray_tmp, port, base | {"HOME": str(head_home)})
    try:
        address = f"127.0.0.1:{port}"
        serve = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(tiny_llama_dir),
                 "--address", address]  # fmt: skip
        repo = Path(__file__).resolve().parents[2]
        cases = {
            "no token": ({}, "this process sent no token"),
            "another token": (
                {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 32},
                "the token this process sent is not the cluster's",
            ),
        }
        probe = (
            "import sys\nfrom cluster.embedded import probe_cluster\n"
            "print(probe_cluster(sys.argv[1]))"
        )
        right = {"HOME": str(other_home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        # the three clients run side by side (each is mostly a Python start and its imports)
        pipes = {"cwd": repo, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        started = time.monotonic()
        clients = {
            case: subprocess.Popen(serve, env=base | {"HOME": str(other_home)} | extra, **pipes)
            for case, (extra, _) in cases.items()
        }
        clients["probe"] = subprocess.Popen(
            [sys.executable, "-c", probe, address], env=base | right, **pipes
        )
        try:
            for case, (_, cause) in cases.items():
                stdout, stderr = clients[case].communicate(timeout=180)
                elapsed = time.monotonic() - started
                out = stdout + stderr
                assert clients[case].returncode == 2, (case, out[-3000:])
                (line,) = [x for x in out.splitlines() if x.startswith("stepserve: error:")]
                assert "uses token authentication and refused this process" in line, (case, line)
                assert f":{port}" in line and cause in line, (case, line)
                assert "RAY_AUTH_MODE=token" in line and "RAY_AUTH_TOKEN" in line, (case, line)
                assert "Traceback" not in out, (case, out[-3000:])
                assert elapsed < 60, (case, elapsed)  # the interpreters' starts and imports
            stdout, stderr = clients["probe"].communicate(timeout=120)
            assert clients["probe"].returncode == 0, stderr[-3000:]
            assert stdout.strip().endswith(f":{port}"), stdout
        finally:
            for client in clients.values():
                if client.poll() is None:
                    client.kill()
                    client.wait()
    finally:
        _end_group(head, grace_s=45)
        shutil.rmtree(ray_tmp, ignore_errors=True)
