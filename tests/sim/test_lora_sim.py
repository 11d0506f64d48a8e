"""LoRA adapters in the simulator: Zipf-popular adapters in workloads, a replica's LRU of
adapters (loads counted, the least recently used idle one evicted, the load's wait, its report),
adapter-rooted KV events, and adapter-aware routing loading fewer adapters than unaware."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from replica.request import EngineRequest, LoRARequest, Request, SamplingParams
from sim.cluster import DEFAULT_LORA_LOAD_S, SimSettings, Simulation, Workload, simulate
from sim.workloads import RequestSpec, adapter_name, assign_adapters, random_dataset
from tests.sim.test_sim import _config, _profile

LORA_ENGINE = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 2, "block_size": 16}


def _spec(lora: str | None, n: int = 40, seed: int = 0) -> RequestSpec:
    rng = random.Random(seed)
    return RequestSpec([rng.randrange(10, 500) for _ in range(n)], 4, lora=lora)


def _one_replica(load_s: float = 0.05) -> Simulation:
    config = _config(replicas=1, engine=LORA_ENGINE)
    return Simulation(config, _profile(), SimSettings(lora_load_s=load_s, net_latency_s=0.0))


def test_assign_adapters_draws_zipf_popular_names_and_leaves_workloads_alone_by_default() -> None:
    specs = random_dataset(4000, 16, 4, 0.5, random.Random(0))
    assert all(s.lora is None for s in specs)
    assign_adapters(specs, 0, 1.0, random.Random(1))
    assert all(s.lora is None for s in specs)
    assign_adapters(specs, 8, 1.0, random.Random(1))
    counts = Counter(s.lora for s in specs)
    assert set(counts) == {adapter_name(i) for i in range(8)}
    # Zipf(1): the first takes 1 / H(8) = 37%, twice the second's share, 8 times the last's
    assert counts["lora-0"] / len(specs) == pytest.approx(0.368, abs=0.03)
    assert counts["lora-0"] > 1.6 * counts["lora-1"] > 1.6 * counts["lora-7"]


def test_a_replica_loads_an_adapter_once_and_evicts_the_least_recently_used() -> None:
    sim = _one_replica()
    # x, y, x, z, one at a time: z's load evicts y (x was used since), then y loads again
    names = ["x", "y", "x", "z", "y", "x"]
    sim.add_requests([(float(i), _spec(name, seed=i)) for i, name in enumerate(names)])
    result = sim.run()
    replica = sim.replicas[0]
    waited = [r["lora_waited"] for r in result.requests]
    assert waited == [True, True, False, True, True, True]  # x went when y loaded after z
    assert replica.lora_loads == 5
    assert list(replica.loras) == ["y", "x"]  # capacity 2, most recent last
    stats = replica.record_stats(sim.now)
    assert stats.loras == ("y", "x")
    s = result.summary()
    assert s["lora_requests"] == 6 and s["lora_loads"] == 5
    assert s["lora_loads_per_request"] == pytest.approx(5 / 6)


def test_the_load_delays_the_request_and_a_second_request_waits_for_the_same_load() -> None:
    sim = _one_replica(load_s=0.25)
    sim.add_requests([(0.0, _spec("x")), (0.1, _spec("x", seed=1)), (0.0, _spec(None, seed=2))])
    sim.run()
    first, second, base = sim.requests
    assert first.first_sched_at == pytest.approx(first.recv_at + 0.25)
    assert second.first_sched_at >= first.first_sched_at  # waited for the same load
    assert second.first_sched_at < second.recv_at + 0.25
    assert base.first_sched_at == pytest.approx(base.recv_at)  # the base model waits for none
    assert sim.replicas[0].lora_loads == 1
    assert (first.lora_waited, second.lora_waited, base.lora_waited) == (True, True, False)


def test_an_adapter_in_use_is_not_evicted_while_an_idle_one_can_be() -> None:
    sim = _one_replica(load_s=0.01)
    long = RequestSpec([11] * 40, 1500, lora="x")  # still decoding when the others come
    sim.add_requests([(0.0, long), (0.5, _spec("y")), (1.0, _spec("z", seed=1))])
    sim.run()
    assert sim.replicas[0].lora_loads == 3
    assert "x" in sim.replicas[0].loras  # z's load evicted y, which nothing used any more


def test_adapter_requests_hash_their_kv_from_the_adapters_root() -> None:
    config = _config(replicas=1, engine=LORA_ENGINE, routing={"kv_events": True})
    sim = Simulation(config, _profile(), SimSettings(lora_load_s=0.0))
    spec = _spec("x", n=64)
    sim.add_requests([(0.0, spec), (5.0, RequestSpec(spec.prompt_ids, 4))])  # then the base model
    result = sim.run()
    index = sim.ingresses[0].index
    x = LoRARequest("x", "sim://adapters/x")
    mine = Request(EngineRequest(spec.prompt_ids, SamplingParams(max_tokens=1), "r", lora=x))
    mine.update_block_hashes(16)
    assert set(mine.block_hashes) <= index.blocks_of("replica-0")
    # the same prompt on the base model found none of the adapter's blocks cached
    assert [r["hit_tokens"] for r in result.requests] == [0, 0]
    assert [r["predicted_hit_tokens"] for r in result.requests] == [0, 0]


def test_a_workload_with_adapters_needs_enable_lora() -> None:
    sim = Simulation(_config(replicas=1), _profile())
    with pytest.raises(ValueError, match="enable_lora"):
        sim.add_requests([(0.0, _spec("x"))])


def _adapter_workload(n: int, rate: float, seed: int) -> Workload:
    rng = random.Random(seed)
    specs = assign_adapters(random_dataset(n, 48, 8, 0.5, rng), 24, 1.0, rng)
    t, items = 0.0, []
    for spec in specs:
        t += rng.expovariate(rate)
        items.append((t, spec))
    return Workload(requests=items)


def test_adapter_aware_routing_loads_fewer_adapters_than_unaware() -> None:
    engine = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 4}
    loads = {}
    for weight in (0.0, 2.0):
        config = _config(replicas=6, engine=engine, routing={"weight_lora_load": weight})
        result = simulate(config, _profile(), _adapter_workload(600, 60.0, 3), SimSettings(seed=2))
        s = result.summary()
        assert s["completed"] == 600
        loads[weight] = s["lora_loads_per_request"]
    assert loads[2.0] < 0.7 * loads[0.0], loads


def test_the_profile_carries_a_measured_load_time() -> None:
    import json

    from sim.profile import Profile

    prof = _profile()
    assert Simulation(_config(), prof).lora_load_s == DEFAULT_LORA_LOAD_S
    prof.lora_load_s = 0.007
    again = Profile.from_dict(json.loads(json.dumps(prof.as_dict())))
    assert again.lora_load_s == 0.007
    assert Simulation(_config(), again).lora_load_s == 0.007
    assert Simulation(_config(), again, SimSettings(lora_load_s=0.1)).lora_load_s == 0.1


def test_cli_simulate_with_adapters(tmp_path, capsys) -> None:
    import json

    from cluster.cli import main

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_profile().as_dict()))
    rc = main(["simulate", "--profile", str(prof), "--replicas", "3", "--workload", "random",
               "--num-requests", "120", "--rate", "20", "--loras", "16", "--max-cpu-loras", "4",
               "--lora-load-ms", "30", "--out", str(tmp_path / "run")])  # fmt: skip
    assert rc == 0
    assert "adapter loads" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lora_requests"] == 120 and 0 < summary["lora_loads"] <= 120
