"""bench/kv_transfer.py's arguments and configs (no Ray: --dry-run), and the simulator study's
smoke path (bench/kv_transfer_sim.py's workloads)."""

from __future__ import annotations

import pytest

from bench import kv_transfer, kv_transfer_sim


def test_the_real_cluster_bench_builds_its_three_applications(capsys) -> None:
    assert kv_transfer.main(["--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "recompute: routing.kv_transfer=False pd=None",
        "transfer: routing.kv_transfer=True pd=None",
        "pd: routing.kv_transfer=True pd={'prefill_replicas': 1, 'decode_replicas': 3}",
    ]
    with pytest.raises(ValueError, match="must add up to --replicas 4"):
        kv_transfer.main(["--dry-run", "--pd", "2:1"])
    with pytest.raises(SystemExit):
        kv_transfer.parse_args(["--variants", "nope"])


def test_the_simulator_studys_configs_and_long_prompts() -> None:
    pd = kv_transfer_sim.cluster("pd", 64, 0, 0.25)
    assert (pd.pd.prefill_replicas, pd.pd.decode_replicas) == (16, 48)
    assert pd.routing.kv_transfer and not kv_transfer_sim.cluster("recompute", 8, 0, 0.25).pd
    wl = kv_transfer_sim.long_prompts(64, 10.0, 0, 1.0)
    assert len(wl.requests) == 77 and len({spec.prompt_ids[0] for _, spec in wl.requests}) <= 4
