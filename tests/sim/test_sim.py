"""The cluster simulator (sim/): the step-time fit, the same scheduling as the real engine, one
result per seed, workloads and traces, autoscaling, and the CLI."""

from __future__ import annotations

import json
import random

import pytest

from cluster.config import ClusterConfig
from replica.config import EngineConfig
from replica.engine import Engine
from replica.request import SamplingParams
from sim.cluster import SimSettings, Simulation, Workload, simulate
from sim.profile import Profile, StepShape, StepTimeModel, fit, fit_errors, measure
from sim.workloads import (
    TRACES,
    Conversation,
    RequestSpec,
    heterogeneous_dataset,
    multi_turn_conversations,
    read_trace,
)
from tests.helpers import scheduler_request

# a model with a clear shape: 2 ms per step, 20 us per token, attention terms on top
KNOWN = StepTimeModel([1, 64, 512, 2048], [0.002, 0.0033, 0.0123, 0.0430], [2e-8, 4e-8, 1e-7, 5e-5])

SLOW = StepTimeModel(KNOWN.knots, [v * 5 for v in KNOWN.values], KNOWN.attention)


def _profile(model: StepTimeModel = KNOWN, num_kv_blocks: int = 256, max_model_len: int = 2048):
    return Profile(
        meta={"name": "synthetic"},
        engine={},
        capacity={"num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len},
        points=[],
        held_out=[],
        model=model,
    )


def _config(**fields) -> ClusterConfig:
    engine = fields.pop("engine", {})
    return ClusterConfig.model_validate(
        {"engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256, **engine}, **fields}
    )


def _open_loop(n: int, rate: float, seed: int) -> Workload:
    rng = random.Random(seed)
    specs = heterogeneous_dataset(n, 0.1, (64, 16), (512, 64), rng)
    t, items = 0.0, []
    for spec in specs:
        t += rng.expovariate(rate)
        items.append((t, spec))
    return Workload(requests=items)


# -- the step-time model -------------------------------------------------------------------------
def test_fit_recovers_a_known_step_time_model() -> None:
    rng = random.Random(0)
    points = []
    for n in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (16, 256, 1024):
            shape = StepShape.of([], [ctx] * n)
            points.append({"shape": shape, "time_s": KNOWN.predict(shape)})
    for c in (8, 64, 512, 2048):
        for o in (0, 256, 1024):
            shape = StepShape.of([(c, o)], [])
            points.append({"shape": shape, "time_s": KNOWN.predict(shape)})
    model = fit(points)
    assert fit_errors(model, points)["max_abs_rel_error"] < 0.01
    # a mixed step it never saw: priced from its parts
    mixed = StepShape.of([(300, 0), (40, 512)], [rng.randrange(10, 900) for _ in range(12)])
    assert model.predict(mixed) == pytest.approx(KNOWN.predict(mixed), rel=0.02)


def test_step_shape_of_a_scheduler_output_counts_prefill_and_decode() -> None:
    from replica.scheduler import ScheduledRequest, SchedulerOutput

    params = SamplingParams(max_tokens=4)
    prefill = scheduler_request("a", list(range(100)), params)
    decode = scheduler_request("b", list(range(10)), params)
    decode.all_token_ids.append(5)  # one generated token: its next step is a decode
    so = SchedulerOutput(
        scheduled=[ScheduledRequest(prefill, 32, 48, []), ScheduledRequest(decode, 10, 1, [])]
    )
    shape = StepShape.of_scheduler_output(so)
    assert shape == StepShape.of([(48, 32)], [11])
    assert shape.tokens == 49 and shape.requests == 2


def test_profile_measures_the_shapes_it_says_on_a_real_engine(tiny_llama_dir) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), max_num_seqs=8, max_num_batched_tokens=256,
        num_kv_blocks=128, max_model_len=512,
    )  # fmt: skip
    engine = Engine(config)
    seen = []
    engine.step_listeners.append(
        lambda e, so, outs, t: seen.append(StepShape.of_scheduler_output(so))
    )
    prof = measure(engine, quick=True, reps=1)
    assert prof.points and prof.held_out
    kinds = {p["kind"] for p in prof.points + prof.held_out}
    assert kinds == {"decode", "prefill", "mixed"}
    for p in prof.points + prof.held_out:
        assert p["time_s"] > 0
        assert p["shape"] in seen, p["desc"]  # the step that ran, not the one asked for
        if p["kind"] == "decode":
            assert not p["prefill"] and len(p["decode"]) == int(p["desc"].split()[0][2:])
        elif p["kind"] == "prefill":
            c, o = (int(x.split("=")[1]) for x in p["desc"].split())
            assert p["prefill"] == [[c, o]] and not p["decode"]
        else:
            assert p["prefill"] and p["decode"]
    assert engine.scheduler.has_unfinished() is False
    assert {"processor", "cpu_isa", "cpu_isa_detected", "host"} <= set(prof.meta)
    assert {"loadavg_start", "loadavg_max", "other_cores", "busy"} <= set(prof.meta["host"])
    assert all(len(p["samples_s"]) >= 1 for p in prof.points)
    again = Profile.from_dict(json.loads(json.dumps(prof.as_dict())))
    assert again.model.as_dict() == prof.model.as_dict()
    assert [p["shape"] for p in again.points] == [p["shape"] for p in prof.points]


# -- the same scheduler ----------------------------------------------------------------------------
def test_simulated_replica_schedules_exactly_like_the_real_engine(tiny_llama_dir) -> None:
    """Arrivals spread over the run, shared prefixes, chunked prefill and a KV cache small enough
    to preempt: every step's scheduled (request, start, tokens) and preemptions match."""
    engine_fields = dict(
        max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=24, block_size=8,
        max_model_len=256, enable_prefix_caching=True,
        num_speculative_tokens=0,  # the simulator does not model speculation
    )  # fmt: skip
    rng = random.Random(3)
    shared = [rng.randrange(10, 500) for _ in range(40)]
    items = []
    t = 0.0
    for i in range(14):
        prompt = (shared if i % 2 else []) + [
            rng.randrange(10, 500) for _ in range(rng.randint(5, 50))
        ]
        items.append((t, RequestSpec(prompt, rng.randint(3, 30))))
        t += rng.choice([0.0, 0.004, 0.02])
    config = _config(engine=engine_fields, replicas=1)
    sim = Simulation(
        config, _profile(num_kv_blocks=24, max_model_len=256), SimSettings(net_latency_s=0.0)
    )
    sim.step_log = []
    sim.add_requests(items)
    sim.run()
    sim_steps = [(sched, pre) for _, sched, pre in sim.step_log]
    assert any(pre for _, pre in sim_steps), "the run must preempt to test preemption"
    joins = {r.rid: r.joins_step for r in sim.requests}

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), **engine_fields))
    real_steps = []
    engine.step_listeners.append(
        lambda e, so, outs, dt: real_steps.append(
            (
                [(s.request_id, s.start, s.num_tokens) for s in so.scheduled],
                list(so.preempted_request_ids),
            )
        )
    )
    by_step: dict[int, list] = {}
    for req, (_, spec) in zip(sim.requests, items):
        by_step.setdefault(joins[req.rid], []).append((req.rid, spec))
    step = 0
    while step < len(sim_steps):
        step += 1
        for rid, spec in by_step.get(step, []):
            params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, spec.prompt_ids, params)
        engine.step()
    assert not engine.has_unfinished()
    assert real_steps == sim_steps


# -- runs ---------------------------------------------------------------------------------------
def _results(result) -> list[tuple]:
    return [
        (r["id"], r["replica"], r["ttft_s"], r["e2e_s"], r["output_tokens"])
        for r in result.requests
    ]


@pytest.mark.parametrize("router", ["load_aware", "pow2", "round_robin"])
def test_simulation_is_deterministic_per_seed(router) -> None:
    config = _config(replicas=3, routing={"policy": router}, http={"ingress_replicas": 2})
    a = simulate(config, _profile(), _open_loop(150, 30.0, 1), SimSettings(seed=5))
    b = simulate(config, _profile(), _open_loop(150, 30.0, 1), SimSettings(seed=5))
    c = simulate(config, _profile(), _open_loop(150, 30.0, 1), SimSettings(seed=6))
    assert _results(a) == _results(b)
    assert a.summary()["completed"] == 150
    if router != "round_robin":  # the seed drives random choices (ingress pick, pow2 samples)
        assert _results(a) != _results(c)
    assert {r["replica"] for r in a.requests} == {"replica-0", "replica-1", "replica-2"}


def test_overload_queues_at_the_router_and_rejects_past_the_ingress_cap() -> None:
    config = _config(replicas=1, max_ongoing_requests=4, http={"max_pending_requests": 10})
    items = [(0.0, RequestSpec([11] * 40, 20)) for _ in range(30)]
    result = simulate(config, _profile(), Workload(requests=items))
    s = result.summary()
    assert s["completed"] == 14 and s["rejected"] == 16  # 4 on the replica + 10 queued
    peak = max(r for _, r, _ in result.replica_count)
    assert peak == 1


def test_conversation_turns_carry_the_history_and_hit_the_prefix_cache() -> None:
    rng = random.Random(0)
    convs = multi_turn_conversations(6, 2.0, rng, system_len=128, user_len=16, output_len=16,
                                     turns=(3, 3), think_s=0.5)  # fmt: skip
    config = _config(replicas=1, engine={"block_size": 16})
    sim = Simulation(config, _profile())
    sim.add_conversations(convs)
    result = sim.run()
    by_conv: dict[int, list] = {}
    for req in sim.requests:
        by_conv.setdefault(req.conv.conversation_id, []).append(req)
    for conv_id, turns in by_conv.items():
        assert len(turns) == 3
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.arrival > prev.finished_at  # closed loop: after the answer and think time
            history = prev.spec.prompt_ids + convs[conv_id].turns[prev.turn].answer_ids
            assert nxt.spec.prompt_ids[: len(history)] == history
    s = result.summary()
    assert s["completed"] == 18
    assert s["hit_rate"] > 0.5  # system prompts and histories come back from the cache


def test_autoscaling_scales_up_under_load_and_back_down() -> None:
    scaling = dict(enabled=True, min_replicas=1, max_replicas=4, target_queue_depth=4,
                   upscale_delay_s=2, downscale_delay_s=10, look_back_period_s=3)  # fmt: skip
    config = _config(autoscaling=scaling)
    rng = random.Random(2)
    items = [(rng.uniform(0, 30), RequestSpec([rng.randrange(10, 500) for _ in range(64)], 64))
             for _ in range(900)]  # fmt: skip
    items.sort(key=lambda x: x[0])
    for kind in ("stepserve", "ray_default"):
        result = simulate(config, _profile(SLOW), Workload(requests=items),
                          SimSettings(cold_start_s=3.0, autoscaler=kind, min_sim_time_s=90))  # fmt: skip
        counts = [running for _, running, _ in result.replica_count]
        assert counts[0] == 1
        assert max(counts) >= 3, kind
        assert result.summary()["completed"] == 900
        done = max(r["arrival_s"] + r["e2e_s"] for r in result.requests)
        # idle after `done`: back to one replica after the look-back and the downscale delay
        late = [c for t, c, _ in result.replica_count if t > done + 3 + 10 + 2]
        assert late and set(late) == {1}, (kind, result.replica_count[-5:])
        # replica-seconds: the extra replicas were billed from their start (cold start included)
        assert result.replica_seconds > result.end_s


def test_thousand_replicas_route_with_sampled_candidates() -> None:
    config = _config(replicas=1000, routing={"policy": "load_aware", "max_candidates": 8})
    result = simulate(config, _profile(), _open_loop(2000, 2000.0, 4))
    s = result.summary()
    assert s["completed"] == 2000
    assert len({r["replica"] for r in result.requests}) > 600  # spread, not piled up


# -- traces and the CLI ---------------------------------------------------------------------------
def test_shipped_trace_samples_read_in_both_layouts() -> None:
    azure = read_trace(TRACES / "azure_sample.csv")
    mooncake = read_trace(TRACES / "mooncake_sample.jsonl")
    assert len(azure) == len(mooncake) == 200
    for rows in (azure, mooncake):
        times = [r.arrival_s for r in rows]
        assert times[0] == 0.0 and times == sorted(times)
    # Mooncake: rows sharing their first hash id share the first 512 prompt tokens
    lines = [json.loads(x) for x in (TRACES / "mooncake_sample.jsonl").read_text().splitlines()]
    first = {}
    for row, req in zip(lines, mooncake):
        assert len(req.spec.prompt_ids) == row["input_length"]
        first.setdefault(row["hash_ids"][0], []).append(req.spec.prompt_ids[:512])
    shared = [v for v in first.values() if len(v) > 1]
    assert shared and all(p == v[0] for v in shared for p in v)


def test_bad_trace_rows_name_the_line(tmp_path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="t.jsonl:2"):
        read_trace(bad)
    with pytest.raises(ValueError, match="unknown trace layout"):
        read_trace(tmp_path / "t.txt")


def test_cli_simulate_and_plan(tmp_path, capsys) -> None:
    from cluster.cli import main

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_profile().as_dict()))
    out = tmp_path / "run"
    rc = main(["simulate", "--profile", str(prof), "--replicas", "2", "--workload",
               f"trace:{TRACES / 'azure_sample.csv'}", "--num-requests", "100", "--out", str(out),
               "--plots"])  # fmt: skip
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 100
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 100 and "ttft_s" in json.loads(lines[0])
    assert (out / "latency_and_replicas.png").stat().st_size > 1000
    assert (out / "replica_timelines.png").stat().st_size > 1000
    timelines = json.loads((out / "timelines.json").read_text())
    assert set(timelines) == {"replica-0", "replica-1"} and timelines["replica-0"]
    assert "ttft  ms" in capsys.readouterr().out
    rc = main(["plan", "--profile", str(prof), "--workload", "heterogeneous", "--rate", "20",
               "--num-requests", "300", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "replicas meet TTFT" in text
    assert main(["simulate", "--profile", str(tmp_path / "none.json")]) == 2
    assert "no profile at" in capsys.readouterr().err


def test_conversation_prompt_is_system_then_turns() -> None:
    from sim.workloads import Turn

    conv = Conversation(0, 0.0, [1, 2], [Turn([3], 1, [4], 0.0), Turn([5], 1, [6], 0.0)])
    assert conv.prompt(0) == [1, 2, 3]
    assert conv.prompt(1) == [1, 2, 3, 4, 5]
    assert conv.prompt(1, answers=[[9, 9]]) == [1, 2, 3, 9, 9, 5]


def test_serving_calibration_prices_each_step_and_streamed_token() -> None:
    serving = {"model": 2, "step_s": 0.0005, "token_s": 0.0005, "path_latency_s": 0.004}
    items = [(0.0, RequestSpec([11] * 32, 10))]
    config = _config(replicas=1)
    plain = simulate(config, _profile(), Workload(requests=items), SimSettings(net_latency_s=0.0))
    prof = _profile()
    prof.serving = serving
    served = simulate(config, prof, Workload(requests=items), SimSettings(net_latency_s=0.0))
    off = simulate(
        config, prof, Workload(requests=items), SimSettings(net_latency_s=0.0, serving={})
    )
    (a,), (b,), (c,) = plain.requests, served.requests, off.requests
    assert c["e2e_s"] == pytest.approx(a["e2e_s"])  # {}: Engine.step alone
    # one prefill step (streams its first token) and 9 decodes: 0.5 + 0.5 ms more each
    assert b["e2e_s"] == pytest.approx(a["e2e_s"] + 10 * 0.001)
    again = Profile.from_dict(json.loads(json.dumps(prof.as_dict())))
    assert again.serving == serving


def test_kv_event_routing_in_the_simulator_predicts_hits_and_beats_affinity_on_chats() -> None:
    rng = random.Random(4)
    convs = multi_turn_conversations(48, 3.0, rng, num_system_prompts=4, system_len=256,
                                     user_len=32, output_len=32, turns=(3, 6), think_s=1.0)  # fmt: skip
    out = {}
    for name, routing in (("affinity", {"prefix_affinity": True}), ("kv", {"kv_events": True})):
        config = _config(replicas=4, routing=routing, engine={"num_kv_blocks": 160})
        result = simulate(config, _profile(num_kv_blocks=160), Workload(conversations=convs),
                          SimSettings(seed=1), oracle=True)  # fmt: skip
        out[name] = result.summary()
    kv = out["kv"]
    assert kv["hit_prediction_exact"] > 0.9
    assert set(kv["decisions_by_reason"]) <= {"load", "cache", "spill"}
    assert kv["hit_tokens"] <= kv["oracle_hit_tokens"]
    assert kv["prefilled_tokens"] < out["affinity"]["prefilled_tokens"]


def test_prefill_scale_stretches_only_the_prefill_part_of_a_step() -> None:
    from sim.calibrate import serving_step

    serving = {"model": 2, "step_s": 0.0, "token_s": 0.0, "prefill_scale": 2.0}
    decode_only = StepShape.of([], [100] * 4)
    mixed = StepShape.of([(256, 0)], [100] * 4)
    assert serving_step(serving, KNOWN, decode_only, 4) == pytest.approx(KNOWN.predict(decode_only))
    extra = KNOWN.predict(mixed) - KNOWN.predict(decode_only)
    assert serving_step(serving, KNOWN, mixed, 5) == pytest.approx(KNOWN.predict(mixed) + extra)
