"""KV transfer and PD in the simulator (sim/replica.py, sim/ingress.py): the router's fetch
decision is applied (imported blocks are found cached, fewer prompt tokens are prefilled), the
transfer model prices it, PD runs prompts on prefill replicas and continues them on decode
replicas; and the flags that turn them on."""

from __future__ import annotations

import random

import pytest

from cluster.cli import main
from cluster.config import ClusterConfig, PDConfig
from sim.cluster import SimSettings, Workload, simulate
from sim.workloads import RequestSpec, multi_turn_conversations
from tests.sim.test_sim import SLOW, _profile


def _chats(seed: int = 3) -> Workload:
    """Chats busy enough on 4 replicas (SLOW steps) that some turns spill off their holder."""
    rng = random.Random(seed)
    convs = multi_turn_conversations(48, 8.0, rng, num_system_prompts=4, system_len=512,
                                     user_len=32, output_len=32, turns=(3, 6), think_s=0.5)  # fmt: skip
    return Workload(conversations=convs)


# a link well faster than the SLOW profile's prefill (about 4k tokens/s): 10 GB/s
FAST = SimSettings(seed=1, kv_transfer_bytes_per_s=1e10)


def _config(**fields) -> ClusterConfig:
    engine = fields.pop("engine", {})
    return ClusterConfig.model_validate(
        {"engine": {"max_num_seqs": 4, "max_num_batched_tokens": 256, **engine}, **fields}
    )


def test_fetching_spilled_prefixes_prefills_fewer_tokens_than_recomputing() -> None:
    out = {}
    for transfer in (False, True):
        config = _config(replicas=4, routing={"kv_transfer": transfer})
        result = simulate(config, _profile(SLOW, num_kv_blocks=400), _chats(), FAST)
        out[transfer] = result.summary()
    off, on = out[False], out[True]
    assert off["completed"] == on["completed"] == off["requests"]
    assert off["fetches"] == 0 and "fetch" not in off["decisions_by_reason"]
    # a fetch decided is made unless the holder evicted the blocks meanwhile
    assert 0 < on["fetches"] <= on["decisions_by_reason"]["fetch"]
    assert on["fetched_tokens"] > 0
    assert on["prefilled_tokens"] < off["prefilled_tokens"]


def test_a_fetch_waits_for_the_transfer_its_model_prices() -> None:
    config = _config(replicas=4, routing={"kv_transfer": True, "kv_transfer_margin": 0.0})
    fast = simulate(config, _profile(SLOW, num_kv_blocks=400), _chats(), FAST)
    rows = [r for r in fast.requests if r["fetched_tokens"]]
    assert rows
    # one fetch: at least the fixed latency, and the rest by bytes over the rate
    block = config.routing.kv_bytes_per_block
    for r in rows:
        least = config.routing.kv_fetch_latency_s + r["fetched_tokens"] / 16 * block / 1e10
        assert r["fetch_s"] >= least - 1e-9


def test_pd_runs_prompts_on_prefill_replicas_and_decodes_elsewhere() -> None:
    config = _config(pd={"prefill_replicas": 1, "decode_replicas": 2})
    items = [(0.1 * i, RequestSpec([1 + i % 3] * 200 + [100 + i] * 40, 8)) for i in range(12)]
    result = simulate(config, _profile(num_kv_blocks=400), Workload(requests=items),
                      SimSettings(seed=1))  # fmt: skip
    s = result.summary()
    assert s["completed"] == 12 and all(r["output_tokens"] == 8 for r in result.requests)
    roles = {r["replica"]: r["role"] for r in result.replicas}
    assert sorted(roles.values()) == ["decode", "decode", "prefill"]
    assert all(roles[r["replica"]] == "decode" for r in result.requests)  # finished there
    # every request's prompt came to its decode replica by fetch (what it did not hold of the
    # 15 blocks): the decode phase recomputes only the first token
    assert s["fetches"] == 12 and all(r["fetched_tokens"] > 0 for r in result.requests)
    assert all(r["prefilled_tokens"] == 240 - r["hit_tokens"] + 1 for r in result.requests)
    fetched = {r["role"]: r["fetches"] for r in result.replicas if r["fetches"]}
    assert list(fetched) == ["decode"]


def test_pd_config_refuses_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="autoscaling.enabled"):
        ClusterConfig.model_validate({"pd": {"prefill_replicas": 1, "decode_replicas": 1},
                                      "autoscaling": {"enabled": True}})  # fmt: skip
    with pytest.raises(ValueError, match="expected PREFILL:DECODE"):
        PDConfig.parse("2")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        PDConfig.parse("0:2")
    assert PDConfig.parse("1:3") == PDConfig(prefill_replicas=1, decode_replicas=3)


def test_simulate_flags_turn_transfer_and_pd_on(tmp_path, capsys) -> None:
    import json

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_profile(num_kv_blocks=400).as_dict()))
    rc = main(["simulate", "--profile", str(prof), "--workload", "multi-turn", "--num-requests",
               "12", "--rate", "2", "--input-len", "64", "--output-len", "8", "--pd", "1:2",
               "--kv-transfer", "--transfer-gbps", "2", "--fetch-latency-ms", "1",
               "--out", str(tmp_path / "out")])  # fmt: skip
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] == summary["requests"] and summary["fetches"] > 0
    assert main(["simulate", "--profile", str(prof), "--pd", "x"]) == 2
    assert "--pd 'x': expected PREFILL:DECODE" in capsys.readouterr().err
