"""The fidelity report (sim/fidelity.py, `stepserve simulate --compare`): the comparison math
(median, spread, tolerance, pass/fail), replay records, the held-out trace generators (layouts,
rates, shared prefixes), the CLI end to end without Ray, and the failures the simulator models
(replica loss mid-trace, a replica added under load, network variance). No Ray."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from bench.trace_replay import queue_totals, server_totals
from cluster.cli import main as cli_main
from sim.cluster import SimSettings, Simulation, Workload, simulate
from sim.fidelity import (
    check_matches,
    compare,
    format_report,
    median_metrics,
    metrics,
    read_run,
    real_metrics,
    sim_metrics,
    write_run,
)
from sim.heldout import HELDOUT, QUICK
from sim.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    RequestSpec,
    azure_rows,
    mooncake_rows,
    read_azure_trace,
    read_mooncake_trace,
    read_trace,
    write_mooncake_trace,
)
from tests.sim.test_sim import _config, _profile

TINY_PROFILE = "bench-tiny-llama-v1-avx2-1t"


def _real(**values) -> dict:
    return {"completed": 10, "failed": 0, **values}


# -- the comparison ----------------------------------------------------------------------------
def test_compare_median_spread_and_error():
    real = [_real(ttft_p50=0.100), _real(ttft_p50=0.110), _real(ttft_p50=0.120)]
    row = compare(real, {"ttft_p50": 0.121, "failed": 0})["metrics"]["ttft_p50"]
    assert row["median"] == pytest.approx(0.110)
    assert row["spread"] == pytest.approx(0.020 / 0.110)
    assert row["runs_vs_median"] == pytest.approx([0.1 / 0.11 - 1, 0.0, 0.12 / 0.11 - 1])
    assert row["error"] == pytest.approx(0.1)
    assert row["tolerance"] == pytest.approx(0.020 / 0.110)  # the spread (18%) beats the 10% bar
    assert row["ok"]


def test_compare_bar_p50_10_p99_20():
    real = [_real(ttft_p50=1.0, ttft_p99=2.0), _real(ttft_p50=1.0, ttft_p99=2.0)]
    ok = compare(real, {"ttft_p50": 1.09, "ttft_p99": 2.39, "failed": 0})
    assert ok["metrics"]["ttft_p50"]["tolerance"] == 0.10
    assert ok["metrics"]["ttft_p99"]["tolerance"] == 0.20
    assert ok["ok"]
    low_p50 = compare(real, {"ttft_p50": 0.89, "ttft_p99": 2.0, "failed": 0})
    assert not low_p50["metrics"]["ttft_p50"]["ok"] and not low_p50["ok"]
    high_p99 = compare(real, {"ttft_p50": 1.0, "ttft_p99": 2.41, "failed": 0})
    assert not high_p99["metrics"]["ttft_p99"]["ok"] and not high_p99["ok"]


def test_compare_spread_wider_than_the_bar_widens_the_tolerance():
    # the real p99s differ by 30% between runs: an error of 25% is within the runs' own spread
    real = [_real(e2e_p99=1.0), _real(e2e_p99=1.3)]
    row = compare(real, {"e2e_p99": 1.15 * 1.25, "failed": 0})["metrics"]["e2e_p99"]
    assert row["spread"] == pytest.approx(0.3 / 1.15)
    assert row["ok"]
    row = compare(real, {"e2e_p99": 1.15 * 1.27, "failed": 0})["metrics"]["e2e_p99"]
    assert not row["ok"]


def test_compare_one_run_has_no_spread_and_missing_or_failed_fail():
    one = compare([_real(throughput=100.0)], {"throughput": 95.0, "failed": 0})
    assert one["metrics"]["throughput"]["spread"] == 0.0 and one["ok"]
    nan = compare([_real(throughput=100.0)], {"failed": 0})  # the sim has no value
    assert not nan["metrics"]["throughput"]["ok"] and not nan["ok"]
    failed = compare([{**_real(throughput=100.0), "failed": 2}], {"throughput": 100.0, "failed": 0})
    assert failed["metrics"]["throughput"]["ok"] and not failed["ok"]
    assert "2 real requests failed" in format_report(failed)
    unfinished = compare([_real(throughput=100.0)], {"throughput": 100.0, "failed": 1})
    assert not unfinished["ok"]
    with pytest.raises(ValueError, match="no real runs"):
        compare([], {})


def test_queue_mean_is_shown_not_judged():
    report = compare([_real(queue_mean=0.01)], {"queue_mean": 0.05, "failed": 0})
    row = report["metrics"]["queue_mean"]
    assert row["error"] == pytest.approx(4.0) and "ok" not in row
    assert report["ok"]
    assert "(shown)" in format_report(report)


def test_compare_judges_the_median_of_several_simulations_and_shows_their_spread():
    real = [_real(ttft_p50=1.0), _real(ttft_p50=1.0)]
    sims = [{"ttft_p50": v, "failed": f} for v, f in ((0.8, 0), (1.05, 0), (1.3, 1))]
    sim = median_metrics(sims)
    assert sim == {"ttft_p50": 1.05, "failed": 1}  # the worst seed's unfinished count
    report = compare(real, sim, sims)
    row = report["metrics"]["ttft_p50"]
    assert row["sim"] == 1.05 and row["ok"]  # one far seed does not decide the verdict
    assert row["sim_runs"] == [0.8, 1.05, 1.3]
    assert row["sim_spread"] == pytest.approx(0.5 / 1.05)
    assert not report["ok"]  # a seed that left requests unfinished fails the report
    assert "sim-spr" in format_report(report)
    with pytest.raises(ValueError, match="no simulations"):
        median_metrics([])


def test_metrics_of_rows():
    rows = [
        {"success": True, "start_s": float(i), "ttft_s": 0.1 * (i + 1), "e2e_s": 1.0,
         "tpot_s": None if i == 0 else 0.01 * i, "output_tokens": 10}
        for i in range(5)
    ] + [{"success": False, "start_s": 9.0, "ttft_s": 0.0, "e2e_s": 0.0, "tpot_s": None,
          "output_tokens": 0}]  # fmt: skip
    m = metrics(rows)
    assert m["completed"] == 5 and m["failed"] == 1
    assert m["ttft_p50"] == pytest.approx(0.3)
    assert m["ttft_p99"] == pytest.approx(0.1 * (4 + 1 - 0.04))  # numpy's linear interpolation
    assert m["tpot_p50"] == pytest.approx(0.025)  # over the 4 rows that have one
    assert m["throughput"] == pytest.approx(50 / 5.0)  # first send 0 s, last end 5 s


# -- replay records ----------------------------------------------------------------------------
def _row(i: int, prompt: int, ttft: float = 0.05) -> dict:
    return {"index": i, "arrival_s": i * 0.5, "start_s": i * 0.5, "prompt_tokens": prompt,
            "output_tokens": 8, "expected_output_tokens": 8, "success": True, "ttft_s": ttft,
            "tpot_s": 0.01, "e2e_s": ttft + 0.07, "error": ""}  # fmt: skip


def test_replay_record_round_trip_and_checks(tmp_path):
    path = tmp_path / "real.jsonl"
    meta = {"trace": "t.csv", "seed": 1, "time_scale": 1.0, "queue_time_s_sum": 0.5,
            "queue_time_count": 10}  # fmt: skip
    write_run(path, meta, [_row(0, 100), _row(1, 200)])
    run = read_run(path)
    assert run.meta == meta and len(run.rows) == 2 and run.rows[1]["prompt_tokens"] == 200
    assert real_metrics(run)["queue_mean"] == pytest.approx(0.05)
    check_matches(run, [100, 200])
    with pytest.raises(ValueError, match="2 requests, the trace has 3"):
        check_matches(run, [100, 200, 300])
    with pytest.raises(ValueError, match="request 1 has 200 prompt tokens, the trace's has 201"):
        check_matches(run, [100, 201])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ttft": 1}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: type None"):
        read_run(bad)
    bad.write_text(json.dumps({"type": "request", "ttft_s": 1}) + "\n")
    with pytest.raises(ValueError, match="lacks e2e_s, output_tokens, success"):
        read_run(bad)


def test_capacity_probe_counts_the_middle_half_of_the_finishes():
    from bench.sim_fidelity import saturated_rate

    # a slow start (the queue filling) and a long tail (the last ones alone) left out: 4/s
    finishes = [5.0, 6.0, 7.0] + [10.0 + i * 0.25 for i in range(10)] + [20.0, 30.0, 40.0]
    assert saturated_rate(finishes) == pytest.approx(4.0)


def test_queue_totals_sums_every_label_set():
    text = (
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        'vllm:request_queue_time_seconds_bucket{le="0.1",replica="a"} 3\n'
        'vllm:request_queue_time_seconds_sum{replica="a"} 0.25\n'
        'vllm:request_queue_time_seconds_count{replica="a"} 4\n'
        'vllm:request_queue_time_seconds_sum{replica="b"} 0.75\n'
        'vllm:request_queue_time_seconds_count{replica="b"} 6\n'
        "vllm:other_sum 99\n"
    )
    assert queue_totals(text) == (pytest.approx(1.0), 10.0)


def test_server_totals_read_counters_and_the_step_histogram():
    text = (
        'vllm:prefix_cache_queries_total{replica="a"} 1000\n'
        'vllm:prefix_cache_queries_total{replica="b"} 500\n'
        'vllm:prefix_cache_hits_total{replica="a"} 640\n'
        'stepserve:engine_step_duration_seconds_sum{replica="a"} 12.5\n'
        'stepserve:engine_step_duration_seconds_count{replica="a"} 250\n'
        "vllm:num_preemptions_total 3\n"
    )
    t = server_totals(text)
    assert t["prefix_cache_queries"] == 1500 and t["prefix_cache_hits"] == 640
    assert t["engine_steps"] == 250 and t["engine_step_s_sum"] == pytest.approx(12.5)
    assert t["preemptions"] == 3 and t["queue_time_count"] == 0


def test_server_figures_are_shown_for_real_and_simulated_runs_not_judged(tmp_path):
    path = tmp_path / "real.jsonl"
    meta = {"trace": "t.csv", "prefix_cache_queries": 1000, "prefix_cache_hits": 250,
            "engine_steps": 40, "engine_step_s_sum": 2.0}  # fmt: skip
    write_run(path, meta, [_row(0, 100), _row(1, 200)])
    real = real_metrics(read_run(path))
    assert real["hit_rate"] == 0.25 and real["steps"] == 40 and real["step_mean"] == 0.05
    reps = [{"prefix_cache_queries": 600, "prefix_cache_hits": 300, "steps": 30, "busy_s": 3.0},
            {"prefix_cache_queries": 400, "prefix_cache_hits": 0, "steps": 10, "busy_s": 1.0}]  # fmt: skip
    rows = [{"status": "ok", "arrival_s": 0.0, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 0.2,
             "output_tokens": 5, "queue_s": 0.0}]  # fmt: skip
    sim = sim_metrics(rows, reps)
    assert sim["hit_rate"] == 0.3 and sim["steps"] == 40 and sim["step_mean"] == 0.1
    report = compare([real], sim)
    assert "ok" not in report["metrics"]["hit_rate"] and report["ok"] is not None
    text = format_report(report)
    assert "hit_rate" in text and "0.300" in text and "(shown)" in text


# -- held-out traces ---------------------------------------------------------------------------
def test_azure_rows_rate_and_lengths():
    rows = azure_rows(random.Random(3), 3000, 2.5, 300, 40, 1500, 200, sigma=(0.9, 0.8))
    gaps = [b[0] - a[0] for a, b in zip(rows, rows[1:])]
    assert 1 / statistics.mean(gaps) == pytest.approx(2.5, rel=0.06)
    assert statistics.median(r[1] for r in rows) == pytest.approx(300, rel=0.1)
    assert statistics.median(r[2] for r in rows) == pytest.approx(40, rel=0.1)
    assert all(8 <= r[1] <= 1500 and 1 <= r[2] <= 200 for r in rows)
    bursty = azure_rows(random.Random(3), 3000, 2.5, 300, 40, 1500, 200, burstiness=0.5)
    bgaps = [b[0] - a[0] for a, b in zip(bursty, bursty[1:])]
    assert 1 / statistics.mean(bgaps) == pytest.approx(2.5, rel=0.08)
    # gamma shape 0.5: the gaps' coefficient of variation is sqrt(2)
    assert statistics.stdev(bgaps) / statistics.mean(bgaps) == pytest.approx(2**0.5, rel=0.1)


def test_mooncake_rows_share_document_prefixes(tmp_path):
    rows = mooncake_rows(random.Random(5), 400, 4.0, 4, (1, 3), (16, 700), 32, 128)
    for r in rows:  # shared document blocks, then the request's own tokens on its own ids
        shared = [h for h in r["hash_ids"] if h < 1_000_000]
        assert r["hash_ids"][: len(shared)] == shared and len(shared) >= 1
        own = r["input_length"] - len(shared) * MOONCAKE_BLOCK_TOKENS
        assert 16 <= own <= 700
        assert len(r["hash_ids"]) - len(shared) == -(-own // MOONCAKE_BLOCK_TOKENS)
    own_ids = [h for r in rows for h in r["hash_ids"] if h >= 1_000_000]
    assert len(own_ids) == len(set(own_ids))  # a request's own blocks are nobody else's
    firsts = [r["hash_ids"][0] for r in rows]
    assert len(set(firsts)) == 4  # every prompt starts with one of the 4 documents
    # Zipf: the most popular document leads
    assert firsts.count(0) > firsts.count(3000)
    ts = [r["timestamp"] / 1000 for r in rows]
    assert len(rows) / ts[-1] == pytest.approx(4.0, rel=0.15)
    path = tmp_path / "t.jsonl"
    write_mooncake_trace(path, rows)
    trace = read_mooncake_trace(path)
    assert [len(t.spec.prompt_ids) for t in trace] == [r["input_length"] for r in rows]
    a, b = [t for t, r in zip(trace, rows) if r["hash_ids"][0] == 0][:2]
    assert a.spec.prompt_ids[:MOONCAKE_BLOCK_TOKENS] == b.spec.prompt_ids[:MOONCAKE_BLOCK_TOKENS]
    # another salt: other tokens, the same sharing
    salted = read_mooncake_trace(path, salt=1)
    a2, b2 = [t for t, r in zip(salted, rows) if r["hash_ids"][0] == 0][:2]
    assert a2.spec.prompt_ids[:MOONCAKE_BLOCK_TOKENS] != a.spec.prompt_ids[:MOONCAKE_BLOCK_TOKENS]
    assert a2.spec.prompt_ids[:MOONCAKE_BLOCK_TOKENS] == b2.spec.prompt_ids[:MOONCAKE_BLOCK_TOKENS]
    assert [t.arrival_s for t in salted] == [t.arrival_s for t in trace]


@pytest.mark.parametrize("trace", HELDOUT + QUICK, ids=lambda t: f"{t.name}-{t.num_requests}")
def test_heldout_traces_write_their_layout_at_their_rate(trace, tmp_path):
    path = trace.write(tmp_path / f"t{trace.suffix}", rate=2.0, seed=1)
    header = path.read_text().splitlines()[0]
    if trace.layout == "azure":
        assert header == "TIMESTAMP,ContextTokens,GeneratedTokens"
        rows = read_azure_trace(path)
    else:
        assert set(json.loads(header)) == {"timestamp", "input_length", "output_length", "hash_ids"}
        rows = read_mooncake_trace(path)
    assert len(rows) == trace.num_requests and rows[0].arrival_s == 0.0
    assert (len(rows) - 1) / rows[-1].arrival_s == pytest.approx(2.0, rel=0.5)
    assert read_trace(path, seed=3)[5].spec.num_prompt_tokens == rows[5].spec.num_prompt_tokens


def test_heldout_set_covers_loads_and_layouts():
    assert sorted(t.load for t in HELDOUT) == [0.3, 0.6, 0.9]
    assert {t.layout for t in HELDOUT} == {"azure", "mooncake"}
    assert all(100 <= t.num_requests <= 150 for t in HELDOUT)


# -- the CLI (no Ray) --------------------------------------------------------------------------
def _trace_and_records(tmp_path, scale_ttft: float = 1.0):
    """A trace, simulated; its results written as two 'real' replay records (the second 3%
    slower), TTFT scaled by `scale_ttft`."""
    trace = QUICK[0].write(tmp_path / "trace.csv", rate=3.0, seed=2)
    argv = ["simulate", "--profile", TINY_PROFILE, "--replicas", "2", "--workload",
            f"trace:{trace}", "--out", str(tmp_path / "sim")]  # fmt: skip
    assert cli_main(argv) == 0
    sims = [json.loads(x) for x in (tmp_path / "sim" / "requests.jsonl").read_text().splitlines()]
    sims.sort(key=lambda r: int(r["id"][1:]))
    records = []
    for k, slow in ((1, 1.0), (2, 1.03)):
        rows = [
            {"index": i, "arrival_s": r["arrival_s"], "start_s": r["arrival_s"],
             "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"],
             "expected_output_tokens": r["output_tokens"], "success": True,
             "ttft_s": r["ttft_s"] * scale_ttft * slow, "tpot_s": r["tpot_s"] * slow
             if r["tpot_s"] == r["tpot_s"] else None, "e2e_s": r["e2e_s"] * slow, "error": ""}
            for i, r in enumerate(sims)
        ]  # fmt: skip
        path = tmp_path / f"real{k}.jsonl"
        write_run(path, {"trace": str(trace), "seed": k, "time_scale": 1.0}, rows)
        records.append(str(path))
    return trace, records


def test_cli_compare_passes_against_itself_and_writes_json(tmp_path, capsys):
    trace, records = _trace_and_records(tmp_path)
    out = tmp_path / "report.json"
    argv = ["simulate", "--profile", TINY_PROFILE, "--replicas", "2", "--workload",
            f"trace:{trace}", "--compare", *records, "--compare-json", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "ttft_p50" in text and "verdict: PASS" in text
    report = json.loads(out.read_text())
    assert report["ok"] and set(report["metrics"]) >= {"ttft_p50", "tpot_p99", "throughput"}
    assert report["metrics"]["e2e_p50"]["spread"] == pytest.approx(0.03, abs=1e-3)


def test_cli_compare_fails_when_the_real_ttft_is_twice(tmp_path, capsys):
    trace, records = _trace_and_records(tmp_path, scale_ttft=2.0)
    argv = ["simulate", "--profile", TINY_PROFILE, "--replicas", "2", "--workload",
            f"trace:{trace}", "--compare", *records]  # fmt: skip
    assert cli_main(argv) == 1
    text = capsys.readouterr().out
    assert "verdict: FAIL" in text
    ttft = next(line for line in text.splitlines() if line.startswith("ttft_p50"))
    assert ttft.endswith("FAIL")


def test_cli_compare_simulates_each_seed(tmp_path, capsys):
    trace, records = _trace_and_records(tmp_path)
    out = tmp_path / "report.json"
    argv = ["simulate", "--profile", TINY_PROFILE, "--replicas", "2", "--workload",
            f"trace:{trace}", "--seed", "4", "--compare", *records, "--compare-json", str(out)]  # fmt: skip
    cli_main([*argv, "--sim-seeds", "3"])
    report = json.loads(out.read_text())
    assert report["sim_seeds"] == [4, 5, 6]
    row = report["metrics"]["ttft_p50"]
    assert len(row["sim_runs"]) == 3 and row["sim"] == statistics.median(row["sim_runs"])
    assert "median of 3 seeds" in capsys.readouterr().out
    cli_main([*argv, "--sim-seeds", "1"])
    assert "sim_runs" not in json.loads(out.read_text())["metrics"]["ttft_p50"]
    assert cli_main([*argv, "--sim-seeds", "0"]) == 2
    assert "--sim-seeds 0: at least 1" in capsys.readouterr().err


def test_cli_compare_refuses_other_workloads_and_other_traces(tmp_path, capsys):
    trace, records = _trace_and_records(tmp_path)
    base = ["simulate", "--profile", TINY_PROFILE, "--compare", *records]
    assert cli_main([*base, "--workload", "random"]) == 2
    assert "--compare needs --workload trace:FILE" in capsys.readouterr().err
    assert cli_main([*base, "--workload", f"trace:{trace}", "--num-requests", "5"]) == 2
    assert "the trace has 5" in capsys.readouterr().err
    assert cli_main([*base, "--workload", f"trace:{trace}", "--time-scale", "2"]) == 2
    assert "time scale 1.0" in capsys.readouterr().err


# -- failures and network variance ---------------------------------------------------------------
def _steady(n: int = 120, rate: float = 6.0) -> Workload:
    rng = random.Random(4)
    items = [(i / rate, RequestSpec([rng.randrange(10, 500) for _ in range(64)], 40))
             for i in range(n)]  # fmt: skip
    return Workload(requests=items)


def test_replica_loss_mid_trace_resends_migrates_and_replaces():
    config = _config(replicas=2)
    base = simulate(config, _profile(), _steady(), SimSettings(cold_start_s=3.0))
    lost = simulate(
        config, _profile(), _steady(), SimSettings(cold_start_s=3.0, lose_replica_at_s=(8.0,))
    )
    s = lost.summary()
    assert s["completed"] == 120 and s["lost_replicas"] == 1
    migrated = [r for r in lost.requests if r["migrations"]]
    assert migrated and s["migrations"] == len(migrated)
    # every request still gets exactly its output, a migrated one resumed, not restarted
    assert all(r["output_tokens"] == 40 for r in lost.requests)
    assert len(lost.replicas) == 3
    gone = next(r for r in lost.replicas if r["lost"])
    assert gone["stopped_s"] == 8.0
    new = lost.replicas[2]
    assert new["created_s"] == 8.0 and new["steps"] > 0
    served_by_new = [r for r in lost.requests if r["replica"] == new["replica"]]
    assert min(r["arrival_s"] for r in served_by_new) >= 8.0 - 0.5
    # the outage costs latency: e2e over the requests around it is worse than without it
    window = [i for i, r in enumerate(base.requests) if 8.0 <= r["arrival_s"] < 11.0]
    mean = lambda res: statistics.mean(res.requests[i]["e2e_s"] for i in window)  # noqa: E731
    assert mean(lost) > mean(base)


def test_replica_loss_before_the_first_token_sends_again_from_the_start():
    config = _config(replicas=1)
    # one long prompt, lost while it prefills: it starts over on the replacement
    spec = RequestSpec(list(range(10, 10 + 200)), 4)
    result = simulate(
        config, _profile(), Workload(requests=[(0.0, spec)]),
        SimSettings(cold_start_s=2.0, lose_replica_at_s=(0.0005,)),
    )  # fmt: skip
    (r,) = result.requests
    assert r["status"] == "ok" and r["migrations"] == 1 and r["output_tokens"] == 4
    assert r["ttft_s"] > 2.0  # waited for the replacement's cold start
    assert r["replica"] == "replica-1"


def test_replica_added_under_load_serves_after_its_cold_start():
    config = _config(replicas=1)
    result = simulate(
        config, _profile(), _steady(200, 8.0),
        SimSettings(cold_start_s=4.0, add_replica_at_s=(5.0,), timeline_period_s=0.5),
    )  # fmt: skip
    counts = dict((t, running) for t, running, _ in result.replica_count)
    assert counts[8.5] == 1 and counts[9.5] == 2
    new = [r for r in result.requests if r["replica"] == "replica-1"]
    assert new and all(r["arrival_s"] >= 9.0 - 1.0 for r in new)
    assert result.replicas[1]["created_s"] == 5.0


def test_cold_start_from_the_profile_unless_set():
    config = _config(replicas=1)
    profile = _profile()
    assert Simulation(config, profile).cold_start_s == 10.0
    profile.meta["startup_s"] = 7.5
    assert Simulation(config, profile).cold_start_s == 7.5
    assert Simulation(config, profile, SimSettings(cold_start_s=2.0)).cold_start_s == 2.0


def test_network_jitter_adds_latency_and_zero_jitter_changes_nothing():
    config = _config(replicas=2)
    plain = simulate(config, _profile(), _steady(), SimSettings(net_latency_s=0.002))
    zero = simulate(
        config, _profile(), _steady(), SimSettings(net_latency_s=0.002, net_jitter_s=0.0)
    )
    assert [r["ttft_s"] for r in plain.requests] == [r["ttft_s"] for r in zero.requests]
    jitter = simulate(
        config, _profile(), _steady(), SimSettings(net_latency_s=0.002, net_jitter_s=0.02)
    )
    extra = [j["ttft_s"] - p["ttft_s"] for j, p in zip(jitter.requests, plain.requests)]
    assert statistics.mean(extra) == pytest.approx(0.04, rel=0.35)  # two hops of mean 20 ms
    assert statistics.pstdev(extra) > 0.01
    assert not any(math.isnan(r["ttft_s"]) for r in jitter.requests)


def test_sim_metrics_counts_only_completed_requests():
    rows = [
        {"status": "ok", "arrival_s": 0.0, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 1.0,
         "output_tokens": 20, "queue_s": 0.02},
        {"status": "ok", "arrival_s": 1.0, "ttft_s": 0.3, "tpot_s": math.nan, "e2e_s": 0.3,
         "output_tokens": 1, "queue_s": 0.04},
        {"status": "rejected", "arrival_s": 2.0, "ttft_s": math.nan, "tpot_s": math.nan,
         "e2e_s": math.nan, "output_tokens": 0, "queue_s": math.nan},
    ]  # fmt: skip
    m = sim_metrics(rows)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["queue_mean"] == pytest.approx(0.03)
    assert m["tpot_p50"] == pytest.approx(0.01)
    assert m["throughput"] == pytest.approx(21 / 1.3)


def test_profile_names_the_served_model():
    """`stepserve profile --model default` prices the GGUF `serve` serves; its name drops the
    metadata directory's content hash, and the fidelity study serves the profile's model."""
    from bench.sim_fidelity import served_model
    from sim.cli import profile_model_name

    assert profile_model_name("/c/gguf/SmolLM2-135M-Instruct.Q4_1-184027d7ed76") == (
        "SmolLM2-135M-Instruct-Q4_1"
    )
    assert profile_model_name("/models/Qwen3-0.6B") == "Qwen3-0.6B"
    assert profile_model_name("/models/v1.5-model") == "v1.5-model"
    # a profile whose model is not on this host: the fallback decides
    assert served_model("SmolLM2-135M-Instruct-avx2-1t", "default") in (
        None,
        "/root/.cache/stepserve/SmolLM2-135M-Instruct",
    )
