"""`stepserve` flags reach the config they name (no Ray started)."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest

from cluster.cli import build_config, make_parser
from replica.config import EngineConfig


def parse(*argv: str):
    return build_config(make_parser().parse_args(["serve", *argv]))


def test_cpu_engine_flags_reach_the_engine_config():
    engine = parse(
        "--cpu-decode-attention", "torch", "--no-pack-cpu-weights", "--no-cpu-fused-ops"
    ).engine
    assert engine.cpu_decode_attention == "torch" and engine.pack_cpu_weights is False
    assert engine.cpu_fused_ops is False
    default = parse().engine
    assert default.cpu_decode_attention == "native" and default.pack_cpu_weights is True
    assert default.cpu_fused_ops is True


def test_engine_flags_override_the_config_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  max_num_seqs: 8\n  cpu_decode_attention: torch\n")
    engine = parse("--config", str(path), "--max-num-seqs", "4").engine
    assert engine.max_num_seqs == 4 and engine.cpu_decode_attention == "torch"


def _without_none(annotation):
    """`X | None` -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def test_every_engine_config_field_has_a_flag_in_serve_and_generate():
    """The engine flags are generated from EngineConfig's fields: each field (but those excluded,
    with their reasons, in ENGINE_FLAGS_EXCLUDED) has one, named after it, that sets it alone."""
    from cluster.engine_args import (
        ENGINE_FLAGS_EXCLUDED,
        GENERATE_OWN_FLAGS,
        SERVE_OWN_FLAGS,
        engine_overrides,
    )

    assert all(reason for reason in ENGINE_FLAGS_EXCLUDED.values())
    assert set(ENGINE_FLAGS_EXCLUDED) <= set(EngineConfig.model_fields)
    samples = {int: 8, float: 0.5, str: "x"}
    for command in ("serve", "generate"):
        extra = ["--prompt", "hi"] if command == "generate" else []
        own = GENERATE_OWN_FLAGS if extra else SERVE_OWN_FLAGS  # the command's own flags
        skipped = set(ENGINE_FLAGS_EXCLUDED) | set(own)
        parser = make_parser()
        assert engine_overrides(parser.parse_args([command, *extra])) == {}, "unset: no override"
        for name, field in EngineConfig.model_fields.items():
            if name in skipped:
                continue
            flag = "--" + name.replace("_", "-")
            kind = _without_none(field.annotation)
            if kind is bool:
                on = engine_overrides(parser.parse_args([command, *extra, flag]))
                off = engine_overrides(parser.parse_args([command, *extra, "--no-" + flag[2:]]))
                assert (on, off) == ({name: True}, {name: False}), f"{command} {flag}"
                continue
            if typing.get_origin(kind) is typing.Literal:
                value = [c for c in typing.get_args(kind) if c != field.default][0]
            elif field.default is not None:
                value = field.default
            else:
                value = samples[kind]
            args = parser.parse_args([command, *extra, flag, str(value)])
            assert engine_overrides(args) == {name: value}, f"{command} {flag}"


def test_engine_flag_help_is_the_field_description(capsys, monkeypatch):
    from cluster.engine_args import ENGINE_FLAGS_EXCLUDED, SERVE_OWN_FLAGS

    monkeypatch.setenv("COLUMNS", "1000")  # no wrapped lines
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for name, field in EngineConfig.model_fields.items():
        if name in ENGINE_FLAGS_EXCLUDED:
            continue
        assert "--" + name.replace("_", "-") in text
        if field.description and name not in SERVE_OWN_FLAGS:  # serve's own help (repeatable)
            assert field.description.rstrip(".") in text, name
    assert "--dtype {auto,float32,bfloat16,float16}" in text


def test_flags_of_before_the_generated_ones_work_as_they_did():
    engine = parse(
        "--model",
        "/m",
        "--tp",
        "2",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "4096",
        "--num-kv-blocks",
        "100",
        "--block-size",
        "32",
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
        "--no-prefix-caching",
    ).engine
    assert (engine.model, engine.tensor_parallel_size, engine.max_model_len) == ("/m", 2, 4096)
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (8, 4096)
    assert (engine.num_kv_blocks, engine.block_size) == (100, 32)
    assert (engine.dtype, engine.device, engine.enable_prefix_caching) == ("bfloat16", "cpu", False)
    assert parse("--tensor-parallel-size", "4").engine.tensor_parallel_size == 4
    # generate shares them, and keeps its own --seed (the request's sampling seed)
    from cluster.engine_args import engine_overrides

    args = make_parser().parse_args(
        ["generate", "--prompt", "hi", "--tp", "2", "--no-cpu-fused-ops", "--seed", "3"]
    )
    assert engine_overrides(args) == {"tensor_parallel_size": 2, "cpu_fused_ops": False}
    assert args.seed == 3


def test_quantization_flags_reach_the_engine_config(capsys):
    engine = parse("--quantization", "int8", "--quant-activations", "fp32").engine
    assert (engine.quantization, engine.quant_activations) == ("int8", "fp32")
    default = parse().engine
    assert (default.quantization, default.quant_activations) == ("none", "auto")
    from cluster.engine_args import engine_overrides

    args = make_parser().parse_args(["generate", "--prompt", "hi", "--quantization", "int8"])
    assert engine_overrides(args) == {"quantization": "int8"}
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--quantization", "int4"])
    assert "argument --quantization: invalid choice: 'int4'" in capsys.readouterr().err


def test_serve_resolves_a_gguf_model_once_and_keeps_the_users_path(tmp_path, monkeypatch):
    """`stepserve serve --model x.gguf` makes the file's metadata directory before anything
    starts and passes the file's absolute path on (each process resolves it on its machine);
    the served name is the file's name without .gguf."""
    from cluster.cli import _resolve_model
    from tests.replica.test_gguf_meta import write_gguf

    monkeypatch.setenv("STEPSERVE_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "models" / "Tiny-Q8_0.gguf")
    monkeypatch.chdir(tmp_path)
    config, (model_dir,) = _resolve_model(parse("--model", "models/Tiny-Q8_0.gguf"))
    assert config.engine.model == str(gguf) and config.model_name() == "Tiny-Q8_0"
    assert config.engine.served_model_name == "Tiny-Q8_0"
    assert model_dir.parent == tmp_path / "cache" / "gguf" and (model_dir / "gguf.json").is_file()
    config, (model_dir,) = _resolve_model(parse("--model", "models"))  # the directory holding it
    assert config.model_name() == "models" and (model_dir / "gguf.json").is_file()
    with pytest.raises(SystemExit, match=r"--model 'nope' does not exist"):
        _resolve_model(parse("--model", "nope"))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(SystemExit, match=r"--model 'weights.bin': .*is not a GGUF file"):
        _resolve_model(parse("--model", "weights.bin"))


def test_unset_flags_keep_the_config_file_values(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "engine:\n  enable_prefix_caching: false\n  pack_cpu_weights: false\n  seed: 5\n"
        "  kv_cache_memory_fraction: 0.5\n"
    )
    engine = parse("--config", str(path)).engine
    assert (engine.enable_prefix_caching, engine.pack_cpu_weights) == (False, False)
    assert (engine.seed, engine.kv_cache_memory_fraction) == (5, 0.5)
    engine = parse("--config", str(path), "--prefix-caching", "--seed", "6").engine
    assert (engine.enable_prefix_caching, engine.pack_cpu_weights, engine.seed) == (True, False, 6)


def test_cpu_threads_and_replicas_reach_the_cluster_config():
    config = parse("--cpu-threads", "3", "--replicas", "2")
    assert (config.cpu_threads_per_replica, config.replicas) == (3, 2)
    assert parse().cpu_threads_per_replica is None  # auto: resolved on the replica's machine
    assert parse("--num-cpus-per-replica", "1").num_cpus_per_replica == 1.0


def test_embedded_ray_serve_mode_haproxy_when_a_binary_is_there():
    from cluster.embedded import embedded_ray_serve_env

    env = embedded_ray_serve_env({}, haproxy=True)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "1"
    assert env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"  # Serve's own, once a second
    # HAProxy's stats and metrics listeners get free ports, not Ray's fixed 8404 / 9101
    ports = {int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])}
    assert len(ports) == 2 and not ports & {8404, 9101}
    # without a binary the ingress stays behind Ray's proxy (no direct ingress, no HAProxy ports)
    env = embedded_ray_serve_env({}, haproxy=False)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == env["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env
    # the environment wins, and only what it lacks is added
    env = embedded_ray_serve_env(
        {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}, haproxy=True
    )
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in env and "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in env
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env
    env = embedded_ray_serve_env({"RAY_SERVE_HAPROXY_STATS_PORT": "9999"}, haproxy=True)
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env and "RAY_SERVE_HAPROXY_METRICS_PORT" in env


def test_haproxy_binary_lookup(monkeypatch):
    import importlib.util
    import shutil

    from cluster.embedded import haproxy_available

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not haproxy_available({})  # no package, nothing on the PATH: Ray's proxy stays
    assert haproxy_available({"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"})
    monkeypatch.setattr(
        shutil, "which", lambda name: "/usr/sbin/haproxy" if name == "haproxy" else None
    )
    assert haproxy_available({})


def test_kv_events_flag_sets_routing_and_unset_keeps_the_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("routing:\n  kv_events: false\n  weight_cache_hit: 4\n")
    assert parse("--config", str(path)).routing.kv_events is False
    routing = parse("--config", str(path), "--kv-events").routing
    assert (routing.kv_events, routing.weight_cache_hit) == (True, 4.0)
    assert parse("--no-kv-events").routing.kv_events is False


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free():
    """A server that closed its connections first leaves them in TIME_WAIT for up to a minute;
    HAProxy and uvicorn bind over those (SO_REUSEADDR on both sides: Linux lets a socket bind
    over TIME_WAIT connections of a listener that had it), so they must not refuse a restart. A
    listening socket still counts."""
    import socket

    from cluster.processes import port_in_use

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and HAProxy do
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert port_in_use("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server's side closes first: it is the one left in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    states = Path("/proc/net/tcp").read_text()
    assert f":{port:04X} " in states  # the TIME_WAIT connection is there
    assert not port_in_use("127.0.0.1", port)


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--tp", "2"], {}),
        (["--engine-core", "thread"], {}),
        (["--device", "cuda"], {}),
        (["--min-replicas", "0", "--max-replicas", "2"], {}),
        ([], {"STEPSERVE_PRESTART_CORE": None}),
        ([], {"STEPSERVE_PRESTART_CORE": "0"}),
    ],
    ids=["tp2", "thread-core", "cuda", "no-replica-at-start", "not-asked", "turned-off"],
)
def test_no_prestarted_core_where_no_replica_would_adopt_it(argv, env, monkeypatch):
    """The engine core is started before Ray only when asked (STEPSERVE_PRESTART_CORE=1), for
    a CPU (or auto) core process at tp=1 with a replica at start: these return before starting
    anything."""
    from cluster import embedded

    monkeypatch.setenv("STEPSERVE_PRESTART_CORE", "1")
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key)
        else:
            monkeypatch.setenv(key, value)
    started = []
    monkeypatch.setattr(
        "replica.engine.prestart.PrestartedCore",
        lambda *a, **k: started.append(a) or types.SimpleNamespace(close=lambda: None),
    )
    assert embedded.prestart_core(parse(*argv)) is None
    assert not started
    monkeypatch.setenv("STEPSERVE_PRESTART_CORE", "1")
    assert embedded.prestart_core(parse()) is not None  # asked for, with a replica to adopt it
    assert len(started) == 1
    embedded._prestarted.clear()


def test_free_ports_are_outside_the_kernels_ephemeral_range(monkeypatch):
    """A port the kernel hands to `bind(0)` or an outgoing connection may go to one of Ray's
    processes before Serve's proxy binds it (CI once failed on 'Failed to bind to address'):
    free_port picks where the kernel does not, and skips a port a listener holds."""
    import socket

    from cluster import processes

    low, high = processes._ephemeral_ports()
    ports = {processes.free_port() for _ in range(20)}
    assert all(processes._LISTEN_PORTS[0] <= p < processes._LISTEN_PORTS[1] for p in ports), ports
    assert not any(low <= p <= high for p in ports)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(processes, "_ephemeral_ports", lambda: (1, 2))
        monkeypatch.setattr(processes, "_LISTEN_PORTS", (taken, taken + 1))
        other = processes.free_port()  # the only candidate is held: any free port instead
        assert other != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", other))


def test_serve_starts_its_proxies_where_the_config_says_head_only_by_default(tmp_path):
    """serve.start's options (stepserve serve, --address included): Serve's HeadOnly unless
    the config asks for every_node."""
    from cluster.app import serve_start_options

    options = serve_start_options(parse("--host", "0.0.0.0", "--port", "8123"))
    assert options == {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "0.0.0.0", "port": 8123},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text("http:\n  proxy_location: every_node\n")
    assert serve_start_options(parse("--config", str(path)))["proxy_location"] == "EveryNode"
    path.write_text("http:\n  proxy_location: everywhere\n")
    with pytest.raises(ValueError, match="proxy_location"):
        parse("--config", str(path))


def test_an_address_where_no_cluster_answers_is_a_clear_error_in_seconds(tiny_llama_dir, capsys):
    """`stepserve serve --address` where nothing listens: exit code 2 and a `stepserve:
    error:` line naming the address and what to do, in seconds (ray.init itself waited more
    than 120 s there, then raised a bare ConnectionError)."""
    import time

    import ray

    from cluster.cli import main
    from cluster.processes import free_port

    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    code = main(["serve", "--model", str(tiny_llama_dir), "--address", address])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("stepserve: error: no Ray cluster answers at "), err
    assert f"(--address {address})" in err and "ray start --head" in err, err
    assert elapsed < 15, elapsed
    assert not ray.is_initialized()
