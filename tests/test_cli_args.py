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
