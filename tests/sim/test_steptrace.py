"""Step traces (sim/steptrace.py, `stepserve steps`, `simulate --step-trace`): a step's shape and
streamed tokens from its trace line, co-running shares, loop gaps, a replay's window, and the
simulator's own trace priced back to exactly what the simulator charged. No Ray."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main as cli_main
from sim.calibrate import serving_step
from sim.heldout import QUICK
from sim.steptrace import (
    TracedStep,
    corun_shares,
    overall,
    read_trace,
    summarise,
    window_of,
)
from tests.sim.test_fidelity import TINY_PROFILE
from tests.sim.test_sim import KNOWN, _config, _open_loop, _profile


def _line(pid, t, dur, rows):
    return json.dumps({"ev": "step", "pid": pid, "t": t, "dur": dur, "reqs": rows})


def test_a_step_line_gives_its_shape_and_streamed_tokens():
    step = TracedStep("1", 10.0, 0.05, [
        ["a", 0, 64, 0, 100],     # a prompt's first chunk: no token out
        ["b", 64, 36, 0, 100],    # its last chunk, after 64 cached: samples
        ["c", 120, 1, 0, 100],    # a decode at context 121
        ["d", 130, 3, 2, 100],    # a decode with two drafts: samples
    ])  # fmt: skip
    shape = step.shape()
    assert shape.tokens == 104 and shape.requests == 4 and shape.decodes == 1
    assert shape.causal_pairs == 64 * 65 / 2
    assert shape.prefix_pairs == 36 * (64 + 37 / 2) + 3 * (130 + 2)
    assert shape.decode_context == 121
    assert step.streamed() == 3 and step.prefill_tokens() == 100 and step.decodes() == 2
    assert step.start == pytest.approx(9.95)


def test_corun_share_is_the_overlap_with_the_other_replicas_steps():
    trace = {
        "1": [TracedStep("1", 1.0, 1.0, []), TracedStep("1", 3.0, 1.0, [])],
        "2": [TracedStep("2", 1.5, 1.0, [])],  # 0.5 - 1.5: half of each of 1's... first only
    }
    shares = corun_shares(trace)
    a, b = trace["1"]
    assert shares[id(a)] == pytest.approx(0.5) and shares[id(b)] == 0.0
    assert shares[id(trace["2"][0])] == pytest.approx(0.5)
    assert corun_shares({"1": [a]})[id(a)] == 0.0  # alone on the host


def test_read_trace_splits_replicas_keeps_a_window_and_counts_loop_gaps(tmp_path):
    path = tmp_path / "steps.jsonl"
    lines = [
        json.dumps({"ev": "add", "pid": 7, "t": 0.9, "rid": "x", "arrival": 0.8}),
        _line(7, 1.00, 0.1, [["x", 0, 10, 0, 10]]),
        _line(7, 1.11, 0.1, [["x", 10, 1, 0, 10]]),  # 10 ms after: the loop's gap
        _line(7, 1.50, 0.1, [["x", 11, 1, 0, 10]]),  # 290 ms after: a long wait
        _line(7, 3.00, 0.1, [["y", 0, 5, 0, 5]]),  # another request: an idle gap, not counted
        _line(8, 1.20, 0.2, [["z", 0, 20, 0, 20]]),
        "",
    ]
    path.write_text("\n".join(lines))
    trace = read_trace(path)
    assert sorted(trace) == ["7", "8"] and len(trace["7"]) == 4
    import gzip

    packed = tmp_path / "steps.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert [len(v) for v in read_trace(packed).values()] == [4, 1]
    s = summarise(trace)
    assert s["7"]["loop_gap_ms_mean"] == pytest.approx(10.0)
    assert s["7"]["long_waits"] == 1 and s["7"]["long_wait_s"] == pytest.approx(0.29)
    assert s["all"]["steps"] == 5 and s["all"]["busy_s"] == pytest.approx(0.6)
    assert s["7"]["mixed_share"] == 0.5 and s["7"]["decode_batch_mean"] == 0.5
    assert overall(s) is s["all"] and overall({"7": s["7"]}) is s["7"]
    windowed = read_trace(path, since=0.95, until=1.45)  # steps that started in it
    assert [len(v) for v in windowed.values()] == [2, 1]
    record = tmp_path / "run.jsonl"
    record.write_text(json.dumps({"type": "run", "monotonic_start": 0.95, "monotonic_end": 1.45}))
    assert window_of(record) == (0.95, 1.45)
    (tmp_path / "old.jsonl").write_text(json.dumps({"type": "run"}) + "\n")
    with pytest.raises(ValueError, match="monotonic_start"):
        window_of(tmp_path / "old.jsonl")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_trace(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("serving", [None, {"model": 2, "step_s": 0.002, "token_s": 0.0007,
                                            "prefill_scale": 1.3, "corun": 0.4}])  # fmt: skip
def test_the_simulators_trace_prices_back_to_what_it_charged(serving):
    """One replica (nothing co-runs): the trace's shapes and streamed tokens, priced again,
    give exactly the simulated step times, so a real trace's ratio measures the model alone."""
    from sim.cluster import simulate

    profile = _profile()
    profile.serving = serving
    trace: list = []
    simulate(_config(), profile, _open_loop(40, 6.0, seed=3), replicas=1, step_trace=trace)
    steps = read_trace_lines(trace)
    s = overall(summarise(steps, profile))
    assert s["steps"] == len(trace) > 40 and s["mixed_share"] > 0
    if serving is None:
        assert s["real_over_engine"] == pytest.approx(1.0, abs=1e-9)
        assert "real_over_serving" not in s
    else:
        assert s["real_over_serving"] == pytest.approx(1.0, abs=1e-9)
        assert s["real_over_engine"] > 1.1  # the serving fit's terms on top
        step = steps["replica-0"][0]
        assert step.dur == pytest.approx(
            serving_step(serving, KNOWN, step.shape(), step.streamed(), 0.0)
        )


def read_trace_lines(lines: list[dict]):
    out: dict = {}
    for d in lines:
        out.setdefault(d["pid"], []).append(TracedStep(d["pid"], d["t"], d["dur"], d["reqs"]))
    return out


def test_cli_simulate_writes_a_trace_and_steps_reads_it(tmp_path, capsys):
    trace = QUICK[0].write(tmp_path / "trace.csv", rate=3.0, seed=2)
    steps = tmp_path / "sim-steps.jsonl"
    argv = ["simulate", "--profile", TINY_PROFILE, "--replicas", "2", "--workload",
            f"trace:{trace}", "--step-trace", str(steps)]  # fmt: skip
    assert cli_main(argv) == 0
    lines = [json.loads(x) for x in steps.read_text().splitlines()]
    assert {d["pid"] for d in lines} == {"replica-0", "replica-1"}
    capsys.readouterr()
    out = tmp_path / "steps.json"
    assert cli_main(["steps", str(steps), "--profile", TINY_PROFILE, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "real_over_engine" in text and "sim-steps" in text  # (a profile without serving)
    summary = json.loads(out.read_text())[str(steps)]
    assert summary["all"]["steps"] == len(lines)
    assert cli_main(["steps", str(steps), "--per-replica"]) == 0
    assert "replica-1" in capsys.readouterr().out
    slow = tmp_path / "slow-steps.jsonl"  # --host-spread reaches the simulation
    assert cli_main([*argv[:-1], str(slow), "--host-spread", "0.3"]) == 0
    assert "host spread 0.300" in capsys.readouterr().out
    durs = [json.loads(x)["dur"] for x in slow.read_text().splitlines()]
    assert durs[:5] != [d["dur"] for d in lines[:5]]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli_main(["steps", str(empty)]) == 2
    assert "no steps" in capsys.readouterr().err


# served steps priced with known terms: what the fits must recover
TRUTH = {"model": 2, "step_s": 0.003, "token_s": 0.0009, "prefill_scale": 1.25, "corun": 0.3,
         "replicas": 2}  # fmt: skip


def _two_replica_trace() -> list[dict]:
    """The simulator's step trace of two replicas on one host (co-running steps) priced with
    TRUTH."""
    from sim.cluster import simulate

    profile = _profile()
    profile.serving = TRUTH
    trace: list = []
    simulate(_config(replicas=2), profile, _open_loop(160, 14.0, seed=5), step_trace=trace)
    return trace


def test_fit_steps_recovers_the_terms_the_simulator_charged():
    from sim.steptrace import fit_steps

    truth = TRUTH
    trace = _two_replica_trace()
    fit = fit_steps([read_trace_lines(trace)], KNOWN)
    assert fit["steps"] == len(trace)
    assert fit["step_s"] == pytest.approx(truth["step_s"], abs=0.0005)
    assert fit["token_s"] == pytest.approx(truth["token_s"], abs=0.0001)
    assert fit["prefill_scale"] == pytest.approx(truth["prefill_scale"], abs=0.05)
    assert fit["corun"] == pytest.approx(truth["corun"], abs=0.05)
    groups = fit["fit_error"]
    assert {"decode alone", "decode corun", "mixed corun"} <= set(groups)
    assert all(abs(g["sum_error"]) < 0.03 for g in groups.values())
    with pytest.raises(ValueError, match="cannot fit"):
        fit_steps([{"r": read_trace_lines(trace)["replica-0"][:5]}], KNOWN)


def test_measure_serving_fits_the_step_terms_on_the_clusters_traces(tmp_path, monkeypatch):
    """The calibration's glue: with the clusters' step traces the step terms come from the
    served steps and the rows fit the path; a missing or empty trace falls back to the rows."""
    import random

    import sim.calibrate as calibrate
    from tests.sim.test_sim_model import TRUE, _rows

    truth = TRUTH
    profile = _profile()
    trace = _two_replica_trace()
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in trace))
    # the client's measurements of the same cluster: its step terms, and a path
    same = {**TRUE, "step_s": 0.003, "token_s": 0.0009, "prefill_extra": 0.25, "corun": 0.3}
    rows = _rows(KNOWN, same, random.Random(5), noise=0.02, outliers=0)
    monkeypatch.setattr(calibrate, "measure_rows", lambda *a, **k: list(rows))
    s = calibrate.measure_serving("http://unused", profile, 2, step_traces=[path],
                                  progress=lambda *_: None)  # fmt: skip
    assert s["step_fit"]["steps"] == len(trace)
    assert s["token_s"] == pytest.approx(truth["token_s"], abs=0.0001)
    assert s["corun"] == pytest.approx(truth["corun"], abs=0.05)
    assert s["path_latency_s"] == pytest.approx(TRUE["path"], abs=0.002)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for traces in ([], [empty], [tmp_path / "missing.jsonl"]):
        s = calibrate.measure_serving("http://unused", profile, 2, step_traces=traces,
                                      progress=lambda *_: None)  # fmt: skip
        assert "step_fit" not in s
        assert s["token_s"] == pytest.approx(same["token_s"], abs=0.0002)  # the rows' own fit


def test_ttft_parts_split_a_replays_first_tokens_by_the_core_trace(tmp_path, capsys):
    """A request sent at 10.00 reaches the core's front at 10.02, the core reads it at 10.30
    (after the step under way), schedules it at 10.31 in a two-chunk prefill that samples at
    10.80, and the client has the token at 10.85; a second one of another length likewise."""
    from sim.fidelity import write_run
    from sim.steptrace import ttft_parts

    lines = [
        {"ev": "add", "pid": 1, "t": 10.30, "rid": "a", "arrival": 10.02},
        {"ev": "step", "pid": 1, "t": 10.50, "dur": 0.19, "reqs": [["a", 0, 64, 0, 100]]},
        {"ev": "step", "pid": 1, "t": 10.80, "dur": 0.29, "reqs": [["a", 64, 36, 0, 100]]},
        {"ev": "add", "pid": 1, "t": 11.05, "rid": "b", "arrival": 11.04},
        {"ev": "step", "pid": 1, "t": 11.20, "dur": 0.14, "reqs": [["b", 0, 20, 0, 20]]},
    ]
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(d) + "\n" for d in lines))
    rows = [
        {"index": 0, "start_s": 0.0, "prompt_tokens": 100, "success": True, "ttft_s": 0.85},
        {"index": 1, "start_s": 1.0, "prompt_tokens": 20, "success": True, "ttft_s": 0.25},
        {"index": 2, "start_s": 2.0, "prompt_tokens": 7, "success": False, "ttft_s": None},
    ]
    for row in rows:
        row.update(output_tokens=4, e2e_s=1.0)
    record = tmp_path / "real1.jsonl"
    write_run(record, {"monotonic_start": 10.0, "monotonic_end": 13.0}, rows)
    parts = ttft_parts(trace, record)
    assert parts["requests"] == 3 and parts["matched"] == 2
    assert parts["path_in"]["p50"] == pytest.approx(0.03)  # 0.02 and 0.04
    assert parts["handoff"]["mean"] == pytest.approx((0.28 + 0.01) / 2)
    assert parts["prefill"]["mean"] == pytest.approx((0.49 + 0.14) / 2)
    assert parts["path_out"]["mean"] == pytest.approx((0.05 + 0.05) / 2)
    assert parts["ttft"]["mean"] == pytest.approx(0.55)
    assert cli_main(["steps", f"{trace}@{record}", "--ttft"]) == 0
    out = capsys.readouterr().out
    assert "2 of 3 requests matched" in out and "handoff" in out
    write_run(record, {"monotonic_start": 20.0, "monotonic_end": 21.0}, rows)
    with pytest.raises(ValueError, match="no `add` lines"):
        ttft_parts(trace, record)


def test_profile_refuses_a_step_trace_without_the_cluster_it_belongs_to(capsys):
    argv = ["profile", "--from", TINY_PROFILE, "--calibrate-step-trace", "steps.jsonl"]
    assert cli_main(argv) == 2
    assert "--calibrate-step-trace is the trace of the cluster at --calibrate-url" in (
        capsys.readouterr().err
    )


def test_the_calibration_measures_one_stream_alone_on_the_n_replica_cluster(monkeypatch):
    """With N > 1 replicas the calibration first runs one stream at a time (the other replicas
    idle): decode rows at busy 0 on that cluster, besides the levels with every replica busy."""
    import sim.calibrate as calibrate

    levels = []

    async def fake_loop(base_url, concurrency, prompt_len, out_len, seconds, seed, **kw):
        levels.append((concurrency, seconds, kw.get("probe", False)))
        return calibrate.LevelRun([(0.05, 0.02, 20)] * 3, [0.06] * 2 if kw.get("probe") else [],
                                  100.0)  # fmt: skip

    monkeypatch.setattr(calibrate, "_closed_loop", fake_loop)
    monkeypatch.setattr(calibrate, "_idle_probes", lambda url, n: [0.04] * n)
    rows = calibrate.measure_rows("http://unused", _profile(), 2, batches=(1, 4), seconds=3.0,
                                  rounds=1, prefill_prompts=(), progress=lambda *_: None)  # fmt: skip
    # the alone level first: one stream, no prober, both rounds' time; then 2 x b streams
    assert levels == [(1, 3.0, False), (2, 3.0, True), (8, 3.0, True)]
    decode = [r for r in rows if r.group == "decode"]
    alone = [r for r in decode if r.x[5] == 0.0]
    assert len(alone) == 3 and all(r.level == "b=1 solo" for r in alone)
    assert {r.level for r in decode if r.x[5] > 0} == {"b=1", "b=4"}
    # one replica: no alone level (every step is alone already)
    levels.clear()
    calibrate.measure_rows("http://unused", _profile(), 1, batches=(1,), seconds=3.0, rounds=1,
                           prefill_prompts=(), progress=lambda *_: None)  # fmt: skip
    assert levels == [(1, 3.0, True)]


def test_host_spread_scales_each_hosts_steps_by_one_seeded_draw():
    """SimSettings.host_spread: every step of a host costs its price times that host's draw
    (both replicas of a two-replica host share it); 0 is the plain run, a seed repeats;
    host_level scales every host."""
    import math

    from sim.cluster import SimSettings, simulate

    profile = _profile()
    terms = {**TRUTH, "corun": 0.0}  # two replicas a host; a step's price without its share
    profile.serving = terms
    work = _open_loop(60, 4.0, seed=7)

    def run(spread, seed=0, level=1.0):
        trace: list = []
        settings = SimSettings(host_spread=spread, seed=seed, host_level=level)
        simulate(_config(replicas=4), profile, work, settings, step_trace=trace)
        return trace

    def factors_of(trace) -> dict[str, set]:  # per replica, each step's time over its price
        out: dict[str, set] = {}
        for line in trace:
            step = TracedStep(line["pid"], line["t"], line["dur"], line["reqs"])
            price = serving_step(terms, KNOWN, step.shape(), step.streamed())
            out.setdefault(line["pid"], set()).add(round(line["dur"] / price, 6))
        return out

    plain, none = run(0.0), run(None)  # the profile has no host_spread: None is 0
    assert [s["dur"] for s in plain] == [s["dur"] for s in none]
    assert factors_of(plain) == {f"replica-{i}": {1.0} for i in range(4)}
    assert factors_of(run(0.0, level=1.25)) == {f"replica-{i}": {1.25} for i in range(4)}
    spread = run(0.3)
    factors = factors_of(spread)
    assert all(len(f) == 1 for f in factors.values()), factors  # one factor per replica...
    per = {pid: f.pop() for pid, f in factors.items()}
    assert per["replica-0"] == per["replica-1"] and per["replica-2"] == per["replica-3"]
    assert per["replica-0"] != per["replica-2"]  # ...and per host
    assert all(abs(math.log(v)) < 5 * 0.3 for v in per.values())
    assert [s["dur"] for s in run(0.3)] == [s["dur"] for s in spread]  # the seed repeats
    assert [s["dur"] for s in run(0.3, seed=1)] != [s["dur"] for s in spread]
    with pytest.raises(ValueError, match="host_spread -0.1"):
        run(-0.1)
    with pytest.raises(ValueError, match="host_level 0"):
        run(0.0, level=0.0)


def test_price_level_is_the_median_and_log_spread_of_the_traces():
    from sim.steptrace import price_level

    assert price_level([1.0]) is None and price_level([]) is None
    level = price_level([0.9, 1.0, 1.1])
    assert level["traces"] == 3 and level["median"] == pytest.approx(1.0)
    assert level["log_sd"] == pytest.approx(0.10034, abs=1e-4)
    assert level["level"] == pytest.approx((0.9 * 1.0 * 1.1) ** (1 / 3))


def test_host_level_from_a_step_trace_measures_the_level_it_ran_at(tmp_path, capsys):
    """`--host-level-from`: a one-replica simulated trace at host level 1.2, priced by its own
    profile, measures 1.2; a profile without a serving calibration is refused."""
    from sim.cluster import SimSettings, simulate
    from sim.profile import Profile

    profile = _profile()
    profile.serving = {**TRUTH, "path_latency_s": 0.001, "path_rate_s": 0.0}
    path = tmp_path / "profile.json"
    profile.save(path)
    trace: list = []
    settings = SimSettings(host_level=1.2)
    simulate(_config(), Profile.load(path), _open_loop(40, 6.0, seed=3), settings, replicas=1,
             step_trace=trace)  # fmt: skip
    steps = tmp_path / "steps.jsonl"
    steps.write_text("".join(json.dumps(line) + "\n" for line in trace))
    from sim.cli import measured_host_level

    assert measured_host_level([str(steps)], Profile.load(path)) == pytest.approx(1.2)
    assert measured_host_level([str(steps)] * 2, Profile.load(path)) == pytest.approx(1.2)
    wl = QUICK[0].write(tmp_path / "trace.csv", rate=3.0, seed=2)
    argv = ["simulate", "--profile", str(path), "--replicas", "1", "--workload", f"trace:{wl}",
            "--host-level-from", str(steps)]  # fmt: skip
    assert cli_main(argv) == 0
    assert "host level 1.200" in capsys.readouterr().out
    argv[2] = TINY_PROFILE  # no serving calibration
    assert cli_main(argv) == 2
    assert "needs a profile with a serving calibration" in capsys.readouterr().err


def test_plan_provisions_for_a_slow_hour_of_the_profiles_host_spread(tmp_path, capsys):
    """`stepserve plan` with a host spread in the profile prices every host one deviation up
    (host level exp(S)), unless a host setting is given."""
    profile = _profile()
    profile.serving = {**TRUTH, "path_latency_s": 0.001, "path_rate_s": 0.0, "host_spread": 0.2}
    path = tmp_path / "profile.json"
    profile.save(path)
    argv = ["plan", "--profile", str(path), "--workload", "random", "--rate", "4",
            "--num-requests", "60", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "300"]  # fmt: skip
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "planned for a slow hour" in text and "host level 1.221" in text
    assert cli_main([*argv, "--host-spread", "0"]) == 0
    text = capsys.readouterr().out
    assert "slow hour" not in text and "host level" not in text
