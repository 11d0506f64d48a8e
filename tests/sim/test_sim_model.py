"""The simulator's timing model: the engine fit (repeated points, outliers, negative terms), the
serving calibration's fit (signed coefficients recovered from noisy measurements, a poor fit
warned about), the served step's price, the host checks (busy host, another CPU) and the older
profile layouts still loading."""

from __future__ import annotations

import json
import random

import pytest

from sim.calibrate import (
    PROBE_TOKENS,
    decode_row,
    fit_serving,
    path_extra,
    prefill_row,
    probe_row,
    serving_step,
)
from sim.cluster import SimSettings, Workload, simulate
from sim.host import CpuTimes, cpu_mismatch, host_load
from sim.profile import (
    PROFILES,
    Profile,
    StepShape,
    StepTimeModel,
    fit,
    robust_center,
    upgrade_serving,
)
from sim.workloads import RequestSpec
from tests.sim.test_sim import KNOWN, _config, _profile


def _grid_points(model: StepTimeModel, rng: random.Random, noise: float, repeats: int):
    points = []
    for _ in range(repeats):
        for n in (1, 2, 4, 8, 16, 32, 64):
            for ctx in (16, 256, 1024):
                points.append(StepShape.of([], [ctx] * n))
        for c in (8, 64, 512, 2048):
            for o in (0, 256, 1024):
                points.append(StepShape.of([(c, o)], []))
    return [
        {"shape": s, "time_s": model.predict(s) * (1 + rng.gauss(0, noise)), "desc": str(i)}
        for i, s in enumerate(points)
    ]


def test_fit_recovers_the_model_from_noisy_repeated_points_and_rejects_outliers() -> None:
    rng = random.Random(1)
    points = _grid_points(KNOWN, rng, noise=0.03, repeats=3)
    for i in (5, 40, 77, 90):  # a host hiccup: four points 2.5-4x slow
        points[i]["time_s"] *= 2.5 + i / 100
    model = fit(points)
    rejected = {r["desc"] for r in model.notes["rejected"]}
    assert {"5", "40", "77", "90"} <= rejected
    assert len(rejected) <= 8  # the noise itself is not thrown away
    for shape in (
        StepShape.of([], [100] * 12),
        StepShape.of([(300, 0)], [500] * 6),
        StepShape.of([(128, 256)], []),
        StepShape.of([(1500, 0)], []),
    ):
        assert model.predict(shape) == pytest.approx(KNOWN.predict(shape), rel=0.04)


def test_fit_says_when_it_drops_a_term_it_cannot_resolve() -> None:
    # decode context made to cost negative time: the fit leaves a_decode out and says so
    bad = StepTimeModel(KNOWN.knots, KNOWN.values, [2e-8, 4e-8, -1e-7, 5e-5])
    points = [
        {"shape": p["shape"], "time_s": max(bad.predict(p["shape"]), 1e-4), "desc": p["desc"]}
        for p in _grid_points(KNOWN, random.Random(0), 0.0, 1)
    ]
    model = fit(points)
    assert "a_decode" in model.notes["dropped_terms"] and model.attention[2] == 0.0
    assert any("a_decode" in w for w in model.notes["warnings"])


def test_robust_center_rejects_outlying_samples() -> None:
    center, keep = robust_center([0.010, 0.0101, 0.0099, 0.0102, 0.050, 0.0098])
    assert center == pytest.approx(0.0100, rel=0.02)
    assert keep == [True, True, True, True, False, True]


# -- the serving calibration -----------------------------------------------------------------------
TRUE = {
    "step_s": -0.0015,
    "token_s": 0.0008,
    "prefill_extra": 0.2,
    "path": 0.006,
    "rate": 2e-5,
    "corun": 0.45,
}


def _rows(model: StepTimeModel, truth: dict, rng: random.Random, noise: float, outliers: int):
    """Calibration measurements as `truth` would produce them: each row's y = known + x.coef,
    times noise."""
    coef = (
        truth["step_s"], truth["token_s"], truth["prefill_extra"], truth["path"], truth["rate"],
        truth["corun"],
    )  # fmt: skip
    rows = []
    for _ in range(2):  # two rounds on two replicas: every step beside the other's (busy 1)
        for b in (1, 2, 4, 8, 16, 32):
            rate = 2 * b / 0.02  # two replicas streaming b tokens each per ~20 ms
            rows += [decode_row(model, b, 64, 48, 0.0, 1.0) for _ in range(b * 2)]
            rows += [probe_row(model, b, 88, 0.0, rate, 1.0) for _ in range(6)]
        rows += [prefill_row(model, p, 0.0, 3.0, 1.0) for p in (256, 1024) for _ in range(6)]
    rows += [probe_row(model, 0, 88, 0.0, 0.0, 0.0) for _ in range(12)]
    # the solo rows: one replica alone (busy 0)
    for b in (1, 4, 16):
        rows += [decode_row(model, b, 64, 48, 0.0, 0.0) for _ in range(b * 2)]
        rows += [probe_row(model, b, 88, 0.0, b / 0.02, 0.0) for _ in range(6)]
    rows += [prefill_row(model, 256, 0.0, 1.5, 0.0) for _ in range(6)]
    for r in rows:
        exact = r.known + sum(x * c for x, c in zip(r.x, coef))
        r.y = exact * (1 + rng.gauss(0, noise))
    for r in rng.sample(rows, outliers):
        r.y *= 3.0
    return rows


def test_a_decode_row_prices_the_probes_that_joined_its_steps() -> None:
    # probes at 2/s beside a stream whose steps take 25 ms: 5% of its steps also prefill one
    plain = decode_row(KNOWN, 4, 64, 48, 0.025, 0.0)
    probed = decode_row(KNOWN, 4, 64, 48, 0.025, 0.0, probe_rate=2.0)
    ctx = 64 + 24
    decode = KNOWN.predict(StepShape.of([], [ctx] * 4))
    with_probe = KNOWN.predict(StepShape.of([(PROBE_TOKENS, 0)], [ctx] * 4))
    assert probed.known - plain.known == pytest.approx(0.05 * (with_probe - decode))
    assert probed.x[2] > plain.x[2]  # its prefill part, which prefill_scale scales
    assert probed.x[:2] == plain.x[:2]
    # one probe per step at most
    flooded = decode_row(KNOWN, 4, 64, 48, 0.025, 0.0, probe_rate=1e6)
    assert flooded.known - plain.known == pytest.approx(with_probe - decode)


def test_fit_serving_recovers_signed_coefficients_despite_noise_and_outliers() -> None:
    rows = _rows(KNOWN, TRUE, random.Random(2), noise=0.03, outliers=6)
    s = fit_serving(rows)
    # negative: the cluster's steps are faster than the profile's (no clamp to 0)
    assert s["step_s"] == pytest.approx(TRUE["step_s"], abs=0.0004)
    assert s["token_s"] == pytest.approx(TRUE["token_s"], abs=0.0001)
    assert s["prefill_scale"] == pytest.approx(1 + TRUE["prefill_extra"], abs=0.05)
    assert s["path_latency_s"] == pytest.approx(TRUE["path"], abs=0.001)
    assert s["path_rate_s"] == pytest.approx(TRUE["rate"], rel=0.25)
    assert s["corun"] == pytest.approx(TRUE["corun"], abs=0.05)
    assert sum(e["rejected"] for e in s["fit_error"].values()) >= 6
    assert s["warnings"] == []


def test_fit_serving_warns_when_the_profile_does_not_price_the_cluster() -> None:
    # the cluster's decode step grows with the batch squared: no offset or per-token cost fits it
    rows = _rows(KNOWN, TRUE, random.Random(3), noise=0.02, outliers=0)
    for r in rows:
        if r.group == "decode":
            r.y += 5e-5 * int(r.level[2:].split()[0]) ** 2
    s = fit_serving(rows)
    assert any("poor fit: decode" in w for w in s["warnings"]), s["warnings"]


def test_a_step_beside_its_hosts_busy_replicas_is_slowed_by_corun() -> None:
    serving = {"model": 2, "step_s": 0.001, "token_s": 0.0, "prefill_scale": 1.0, "corun": 0.5}
    step = StepShape.of([], [128] * 4)
    alone = serving_step(serving, KNOWN, step, 4)
    assert alone == pytest.approx(KNOWN.predict(step) + 0.001)
    assert serving_step(serving, KNOWN, step, 4, busy=1.0) == pytest.approx(
        1.5 * KNOWN.predict(step) + 0.001
    )
    assert serving_step({**serving, "corun": 0.0}, KNOWN, step, 4, busy=1.0) == alone


def test_a_step_that_streams_nothing_pays_no_token_cost() -> None:
    serving = {"model": 2, "step_s": 0.001, "token_s": 0.002, "prefill_scale": 1.0}
    chunk = StepShape.of([(256, 0)], [])
    assert serving_step(serving, KNOWN, chunk, 0) == pytest.approx(KNOWN.predict(chunk) + 0.001)
    assert serving_step(serving, KNOWN, chunk, 1) == pytest.approx(KNOWN.predict(chunk) + 0.003)


def test_path_grows_with_the_hosts_streaming_rate_in_the_simulation() -> None:
    serving = {"model": 2, "step_s": 0.0, "token_s": 0.0, "path_latency_s": 0.002,
               "path_rate_s": 1e-4, "replicas": 1}  # fmt: skip
    assert path_extra(serving, 100.0) == pytest.approx(0.01)
    lone = [(0.0, RequestSpec([11] * 32, 4))]
    busy = [(i * 0.01, RequestSpec([11 + i] * 32, 64)) for i in range(8)] + [
        (1.0, RequestSpec([99] * 32, 4))
    ]
    prof = _profile()
    prof.serving = serving
    config = _config(replicas=1)
    settings = SimSettings(net_latency_s=0.002)
    alone = simulate(config, prof, Workload(requests=lone), settings).requests[-1]
    loaded = simulate(config, prof, Workload(requests=busy), settings).requests[-1]
    assert alone["ttft_s"] < loaded["ttft_s"]
    step = KNOWN.predict(StepShape.of([(32, 0)], []))
    assert alone["ttft_s"] == pytest.approx(2 * 0.002 + step, rel=0.05)


# -- the host -------------------------------------------------------------------------------------
def _times(wall, busy, idle, steal, own, load=(0.5, 0.5, 0.5)) -> CpuTimes:
    return CpuTimes(wall, busy, idle, steal, own, load)


def test_host_load_flags_a_busy_host_and_passes_a_quiet_one() -> None:
    start = _times(0.0, 100.0, 100.0, 0.0, 10.0)
    # 10 s on 2 cores: the profiler used 9.9 s, others 0.1 s: quiet
    quiet = host_load(start, _times(10.0, 110.0, 110.0, 0.0, 19.9), cpus=2)
    assert not quiet["busy"] and quiet["other_cores"] == pytest.approx(0.01)
    # others used 8 s of 20: 0.8 cores
    busy = host_load(start, _times(10.0, 118.0, 102.0, 0.0, 20.0, (3.1, 2.0, 1.0)), cpus=2)
    assert busy["busy"] and "0.80 of 2 cores" in busy["busy_reason"]
    assert busy["loadavg_end"] == [3.1, 2.0, 1.0]
    stolen = host_load(start, _times(10.0, 110.0, 108.0, 2.0, 20.0), cpus=2)
    assert stolen["busy"] and "stolen" in stolen["busy_reason"]


def test_busy_profile_and_cpu_mismatch_are_warned_about(capsys, monkeypatch, tmp_path) -> None:
    here = {"processor": "Intel Xeon", "cpu_isa": "avx512", "cpu_isa_detected": "avx512"}
    meta = {"processor": "AMD EPYC", "cpu_isa": "avx2"}
    found = cpu_mismatch(meta, here)
    assert len(found) == 2 and "AMD EPYC" in found[0] and "'avx2'" in found[1]
    assert cpu_mismatch({**meta, **here}, here) == []
    prof = _profile()
    prof.meta.update(here, host={"busy": True, "busy_reason": "other processes used 1.20"})
    path = tmp_path / "p.json"
    prof.save(path)
    monkeypatch.setattr("sim.host.cpu_identity", lambda: {**here, "processor": "Other CPU"})
    from cluster.cli import main

    rc = main(["simulate", "--profile", str(path), "--replicas", "1", "--num-requests", "3"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "busy host: other processes used 1.20" in err
    assert "'Intel Xeon', this host is 'Other CPU'" in err


def test_format_3_profiles_and_interpolated_calibrations_still_load() -> None:
    shipped = Profile.load("SmolLM2-135M-Instruct-avx2-1t")  # format 3
    assert shipped.points and shipped.serving is None
    assert any("no host load" in w for w in shipped.warnings())
    old = {"batches": [1, 2, 4], "extra_s": [0.001, 0.002, 0.003], "prefill_scale": 1.2,
           "path_latency_s": 0.003, "replicas": 2}  # fmt: skip
    new = upgrade_serving(old)
    assert new["token_s"] == pytest.approx(0.000643, rel=0.01)  # the least-squares line
    assert new["prefill_scale"] == 1.2 and new["path_latency_s"] == 0.003
    d = json.loads((PROFILES / "SmolLM2-135M-Instruct-avx2-1t.json").read_text())
    d["serving"] = old
    assert Profile.from_dict(d).serving == new


def test_profile_refuses_a_busy_host_unless_allowed_and_then_flags_it(
    capsys, monkeypatch, tmp_path
) -> None:
    from cluster.cli import main

    busy = {"busy": True, "busy_reason": "other processes used 1.50 of 2 cores", "cpus": 2,
            "loadavg_start": [3.0, 2.0, 1.0]}  # fmt: skip
    monkeypatch.setattr("sim.host.check_quiet", lambda: busy)
    measured = []

    def fake_measure(config, args):
        measured.append(config.model)
        prof = _profile()
        prof.meta.update(
            name="fake", host={"busy": False, "busy_reason": "", "loadavg_start": [0.1] * 3,
                               "loadavg_end": [0.1] * 3, "loadavg_max": 0.2, "other_cores": 0.0,
                               "steal_share": 0.0},
        )  # fmt: skip
        return prof

    monkeypatch.setattr("sim.cli._measure_engine", fake_measure)
    out = tmp_path / "p.json"
    args = ["profile", "--model", "tiny", "--no-serving", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the host is busy (other processes used 1.50 of 2 cores" in err
    assert "--allow-busy-host" in err and not measured and not out.exists()
    assert main([*args, "--allow-busy-host"]) == 0
    saved = Profile.load(out)
    assert saved.meta["host"]["busy"] is True
    assert "before the run: other processes used 1.50" in saved.meta["host"]["busy_reason"]
    assert "busy host" in capsys.readouterr().err


def test_measure_serving_runs_every_measurement_against_a_streaming_server() -> None:
    """The calibration's plumbing end to end (streams, probes, the fit) against a stand-in
    OpenAI-style server whose steps take a fixed time; the real cluster: `stepserve profile`."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sim.calibrate import measure_serving

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(0.002 + 2e-6 * len(body["prompt"]))
            for _ in range(body["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [7]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.003)
            self.wfile.write(b"data: [DONE]\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prof = _profile()
        prof.engine = {"max_num_seqs": 16}
        lines: list[str] = []
        s = measure_serving(
            f"http://127.0.0.1:{server.server_address[1]}", prof, replicas=1, batches=(1, 2, 64),
            out_len=8, seconds=1.6, rounds=1, prefill_prompts=(256,), idle_probes=3,
            progress=lines.append,
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert set(s["fit_error"]) == {"decode", "probe", "prefill", "idle"}
    levels = {r["level"] for r in s["rows"] if r["group"] == "decode"}
    assert levels == {"b=1 solo", "b=2 solo"}  # <= 16; one replica: no step beside another
    assert s["replicas"] == 1 and len(s["host"]["loadavg_start"]) == 3
    assert {"step_s", "token_s", "prefill_scale", "path_latency_s", "path_rate_s", "corun"} <= set(
        s
    )
    assert any("batch   2" in line for line in lines)
    assert s["batches"] == [1, 2] and s["extra_s"][1] == s["step_s"] + 2 * s["token_s"]
    again = Profile.from_dict(json.loads(json.dumps({**prof.as_dict(), "serving": s})))
    assert again.serving["token_s"] == s["token_s"]


def test_the_grid_measures_both_sides_of_a_kernel_switch() -> None:
    """A quantized model's matmuls change path at the crossover: the prefill grid gets chunks
    at both sides of it (quick included), within the token budget."""
    from types import SimpleNamespace

    from sim.profile import _grid, kernel_switches

    config = SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16)
    engine = SimpleNamespace(runner=SimpleNamespace(quant_crossover={"Q4_1": 96, "Q8_0": 4096}))
    assert kernel_switches(engine) == [96, 4096]
    assert kernel_switches(SimpleNamespace(runner=SimpleNamespace())) == []
    for quick in (False, True):
        _, prefill, _ = _grid(config, 8192, 100_000, quick, 32_768, kernel_switches(engine))
        chunks = {c for c, _ in prefill}
        assert {95, 96} <= chunks and not {4095, 4096} & chunks


def test_fit_serving_with_fixed_step_terms_fits_only_the_path() -> None:
    """The step terms fitted on served steps are kept as given; the rows then fit the path,
    and the decode rows check the fixed terms (their error is reported)."""
    rows = _rows(KNOWN, TRUE, random.Random(4), noise=0.02, outliers=0)
    fixed = {name: TRUE[name] for name in ("step_s", "token_s", "prefill_extra", "corun")}
    s = fit_serving(rows, fixed)
    assert (s["step_s"], s["token_s"], s["corun"]) == (
        TRUE["step_s"], TRUE["token_s"], TRUE["corun"],
    )  # fmt: skip
    assert s["prefill_scale"] == 1 + TRUE["prefill_extra"]
    assert s["path_latency_s"] == pytest.approx(TRUE["path"], abs=0.001)
    assert s["fit_error"]["decode"]["median_abs_rel_error"] < 0.05
    # wrong fixed terms show in the decode rows' error, not hidden by the path
    off = fit_serving(rows, {**fixed, "token_s": TRUE["token_s"] + 0.002})
    assert off["fit_error"]["decode"]["bias"] > 0.1
    assert any("poor fit: decode" in w for w in off["warnings"])
    with pytest.raises(ValueError, match="no serving coefficients"):
        fit_serving(rows, {"nope": 1.0})
