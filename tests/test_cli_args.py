"""`stepserve` flags reach the config they name (no Ray started)."""

from __future__ import annotations

from cluster.cli import build_config, make_parser


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


def test_cpu_threads_and_replicas_reach_the_cluster_config():
    config = parse("--cpu-threads", "3", "--replicas", "2")
    assert (config.cpu_threads_per_replica, config.replicas) == (3, 2)
    assert parse().cpu_threads_per_replica is None  # auto: resolved on the replica's machine


def test_embedded_ray_serve_mode_haproxy_when_a_binary_is_there():
    from cluster.cli import embedded_ray_serve_env

    env = embedded_ray_serve_env({}, haproxy=True)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "1"
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

    from cluster.cli import haproxy_available

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not haproxy_available({})  # no package, nothing on the PATH: Ray's proxy stays
    assert haproxy_available({"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"})
    monkeypatch.setattr(
        shutil, "which", lambda name: "/usr/sbin/haproxy" if name == "haproxy" else None
    )
    assert haproxy_available({})
