"""The per-host crossover of the quantized matmuls (replica/quant/crossover.py): which M a timing
table gives, the timing itself (minimum of interleaved repeats, no lower than needed), the disk
cache (hit, miss per thread count), STEPSERVE_QUANT_CROSSOVER, the fallback when timing fails;
the runner's calibration timing on one thread whatever torch's count, with matmuls switching
path exactly there and staying correct; and the default model's logits on either side of the
switch."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from replica.layers import cpu_isa
from replica.quant import crossover, kernels
from replica.quant.formats import QType
from replica.quant.weights import QuantizedWeight
from tests.replica.quant_helpers import prompt_logits
from tests.replica.test_cpu_kernels import needs_native
from tests.replica.test_quant_kernels import make_weight, product

MS = [16, 32, 64, 128, 256, 512]  # the tables of the tests that pass their own Ms
TIMED = list(crossover.MEASURED_M["int8"])  # what crossover_for times


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """No model registered, no table built, an empty cache directory of the test's own."""
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "_registered", {})
    monkeypatch.setattr(kernels, "_crossover", {})
    monkeypatch.setattr(crossover, "cache_dir", lambda: tmp_path / "quant-crossover")


def table_timer(kernel_ms: dict[int, float], dequant_ms: dict[int, float], calls=None):
    """A timer reading a table of ms per M (per weight: two weights take twice as long)."""

    def timer(path, w, m):
        if calls is not None:
            calls.append((path, tuple(w.shape), m))
        return (kernel_ms if path == "kernel" else dequant_ms)[m] * 1e-3

    return timer


# -- the choice ---------------------------------------------------------------------------------
def test_choose_takes_the_smallest_m_from_which_dequantize_wins_at_every_larger_m():
    kernel = [1, 2, 4, 8, 16, 32]
    assert crossover.choose(MS, kernel, [3, 4, 5, 7, 15, 30], 512) == 128
    # a win at 32 below a loss at 64 does not count
    assert crossover.choose(MS, kernel, [3, 1.9, 4.1, 7, 15, 30], 512) == 128
    assert crossover.choose(MS, kernel, [0.5, 1, 2, 4, 8, 16], 512) == 16
    # the kernel ahead (or even) at the largest M: it keeps every measured M
    assert crossover.choose(MS, kernel, [3, 4, 5, 7, 15, 32], 512) == 1024
    assert crossover.choose(MS, kernel, [3, 4, 5, 7, 15, 40], 2048) == 2048


def test_measure_interleaves_repeats_keeps_minima_and_stops_below_the_first_kernel_win():
    """The paths alternate within each M (a busy moment hits both), the minimum of each counts,
    the weights' times add up, and no M below the one where the kernel wins is timed."""
    w1, w2 = make_weight(QType.Q4_1, 4, 64, seed=1), make_weight(QType.Q4_1, 8, 64, seed=2)
    kernel = {512: 10.0, 256: 5.0, 128: 2.5, 64: 1.0, 32: 0.5, 16: 0.25}
    dequant = {512: 6.0, 256: 3.5, 128: 2.0, 64: 1.5, 32: 1.2, 16: 1.1}
    calls = []
    busy = iter([50.0, 50.0])  # the host busy for the first two calls

    def timer(path, w, m):
        calls.append((path, w.shape[0], m))
        spike = next(busy, 0.0)
        return ((kernel if path == "kernel" else dequant)[m] + spike) * 1e-3

    ms, kernel_s, dequant_s = crossover.measure([w1, w2], MS, timer, repeats=3)
    assert ms == [64, 128, 256, 512]
    assert {m for _, _, m in calls} == {64, 128, 256, 512}
    assert [c[0] for c in calls[:6]] == ["kernel", "dequant"] * 3
    assert calls[:6] == [(p, 4, 512) for p in ["kernel", "dequant"] * 3]
    assert kernel_s == pytest.approx([2e-3, 5e-3, 10e-3, 20e-3])  # two weights, minima
    assert dequant_s == pytest.approx([3e-3, 4e-3, 7e-3, 12e-3])
    assert crossover.choose(ms, kernel_s, dequant_s, 512) == 128


# -- cache, override, fallback ------------------------------------------------------------------
def test_the_choice_is_cached_per_cpu_build_and_shapes(tmp_path, monkeypatch):
    w = [make_weight(QType.Q4_1, 64, 64, seed=3)]
    dequant_from_64 = table_timer(
        {m: m for m in TIMED}, {m: (m * 1.5 if m < 64 else m * 0.8) for m in TIMED}
    )
    assert crossover.crossover_for(QType.Q4_1, "int8", w, dequant_from_64) == 64
    (path,) = (tmp_path / "quant-crossover").glob("Q4_1-int8-*.json")
    record = json.loads(path.read_text())
    assert record["crossover"] == 64 and record["ms"] == [m for m in TIMED if m >= 48]
    assert record["key"]["cpu"] and record["key"]["shapes"] == [[64, 64]]
    assert record["key"]["kernels"] and record["key"]["torch"] == torch.__version__

    def not_again(path, w, m):
        raise AssertionError("a cached choice is timed again")

    assert crossover.crossover_for(QType.Q4_1, "int8", w, not_again) == 64
    # other shapes, another CPU or kernel build: another key, timed
    dequant_from_256 = table_timer(
        {m: m for m in TIMED}, {m: m * (2 if m < 256 else 0.9) for m in TIMED}
    )
    other = [make_weight(QType.Q4_1, 32, 64, seed=4)]
    assert crossover.crossover_for(QType.Q4_1, "int8", other, dequant_from_256) == 256
    monkeypatch.setattr(crossover.cpu_isa, "cpu_model", lambda: "Another CPU")
    assert crossover.crossover_for(QType.Q4_1, "int8", w, dequant_from_256) == 256
    assert len(list((tmp_path / "quant-crossover").glob("*.json"))) == 3


@needs_native
def test_each_level_has_a_cached_crossover_of_its_own():
    """The key names the level's kernel build: a crossover timed with avx512's maddubs kernel is
    not read back for avx512_vnni's VNNI one (nor any level's for another's)."""
    w = [make_weight(QType.Q4_1, 64, 64, seed=3)]
    keys = set()
    for level in cpu_isa.runnable_levels():
        with cpu_isa.use_level(level):
            keys.add(crossover._cache_file(crossover.cache_key(QType.Q4_1, "int8", w)))
    assert len(keys) == len(cpu_isa.runnable_levels())


def test_a_failed_measurement_falls_back_to_the_built_in_constants(caplog):
    w = [make_weight(QType.Q5_K, 8, 256, seed=5)]

    def broken(path, w, m):
        raise RuntimeError("kernel exploded")

    with caplog.at_level(logging.WARNING, logger="replica.quant.crossover"):
        assert crossover.crossover_for(QType.Q5_K, "int8", w, broken) == 256
        assert crossover.crossover_for(QType.Q8_0, "fp32", w, broken) == 16
    assert "kernel exploded" in caplog.text and "built-in" in caplog.text
    assert not list(crossover.cache_dir().glob("*.json"))


def test_an_unwritable_cache_keeps_the_measured_choice(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(crossover, "cache_dir", lambda: blocker / "quant-crossover")
    timer = table_timer({m: m for m in TIMED}, {m: m * (0.5 if m >= 32 else 2) for m in TIMED})
    w = [make_weight(QType.Q8_0, 8, 64, seed=9)]
    with caplog.at_level(logging.WARNING, logger="replica.quant.crossover"):
        assert crossover.crossover_for(QType.Q8_0, "int8", w, timer) == 32
    assert "not cached" in caplog.text


def test_the_environment_overrides_or_fixes_the_crossover(monkeypatch):
    monkeypatch.setenv(crossover.ENV, "96")
    table = crossover.table()
    assert {rows for by_type in table.values() for rows in by_type.values()} == {96}
    assert set(table) == set(kernels.ACTIVATIONS) and set(table["int8"]) == kernels.NATIVE_QTYPES
    monkeypatch.setenv(crossover.ENV, "fixed")
    table = crossover.table()
    assert table["int8"][QType.Q4_1] == 512 and table["int8"][QType.Q6_K] == 256
    assert table["fp32"][QType.Q8_0] == 16
    for bad in ("0", "-3", "fast"):
        monkeypatch.setenv(crossover.ENV, bad)
        with pytest.raises(ValueError, match=rf"STEPSERVE_QUANT_CROSSOVER='{bad}'.*'auto'"):
            crossover.table()


# -- the runner's calibration -------------------------------------------------------------------
def model_of(*tensors) -> nn.Module:
    """A module tree holding quantized weights as the loader leaves them."""
    model = nn.Module()
    for i, t in enumerate(tensors):
        layer = nn.Module()
        weight = QuantizedWeight(t.shape, lambda *a: None, "linear", False, "cpu", torch.float32)
        weight.segments = [(0, t)]
        layer.weight = weight
        model.add_module(f"layer{i}", layer)
    return model


@needs_native
def test_calibration_times_on_one_thread_and_the_matmul_switches_there(monkeypatch):
    """A fake timing (de-quantize + GEMM wins from 64 rows), taken while torch runs 2 threads:
    it runs on one, torch gets its 2 back, and the model's type gets that crossover at any thread
    count; a quantized matmul runs the kernel one row below it and de-quantize + GEMM from it,
    both within int8's error of the exact product. A type too small to time keeps the fallback."""
    w = make_weight(QType.Q4_1, 512, 576, seed=6)  # 294912 weights: timed
    small = make_weight(QType.Q8_0, 16, 64, seed=7)  # too small to time
    timed_threads = []

    def fake_native_timer(activations):
        table = table_timer({m: m for m in TIMED}, {m: m * (0.5 if m >= 64 else 2) for m in TIMED})

        def timer(path, w, m):
            timed_threads.append(torch.get_num_threads())
            return table(path, w, m)

        return timer

    monkeypatch.setattr(crossover, "native_timer", fake_native_timer)
    before = torch.get_num_threads()
    dequant_calls = []
    real = kernels._dequant_gemm
    monkeypatch.setattr(
        kernels, "_dequant_gemm", lambda *a: dequant_calls.append(a[1].shape[0]) or real(*a)
    )
    try:
        torch.set_num_threads(2)
        assert crossover.calibrate(model_of(w, small), "int8") == {"Q4_1": 64, "Q8_0": 512}
        assert set(timed_threads) == {1} and torch.get_num_threads() == 2
        assert kernels.crossover_m(QType.Q4_1, "int8") == 64
        assert kernels.crossover_m(QType.Q4_1, "fp32") == 16  # not this model's mode
        wf = w.dequantize()
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for m in (63, 64):
                x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
                y, ref = kernels.quant_matmul(x, w), product(x, wf)
                assert (y - ref).abs().max() < 0.02 * ref.abs().max()
        assert dequant_calls == [64, 64]
    finally:
        torch.set_num_threads(before)


@needs_native
def test_a_bad_override_fails_the_calibration_naming_itself(monkeypatch):
    monkeypatch.setenv(crossover.ENV, "many")
    with pytest.raises(ValueError, match="STEPSERVE_QUANT_CROSSOVER='many'"):
        crossover.calibrate(model_of(make_weight(QType.Q4_1, 8, 64, seed=8)), "int8")


@needs_native
def test_default_model_logits_agree_on_either_side_of_the_switch(default_model_dir, monkeypatch):
    """SmolLM2 (Q4_1, Q8_0 head) as served: its start-up calibration times both of its types;
    the same prompt through the int8 kernel at every M and through de-quantize + GEMM at every
    M gives logits within int8 activations' error and the same top-1 tokens almost everywhere."""
    from tests.replica.test_quant_engine import _runner

    runner = _runner(default_model_dir)
    assert set(runner.quant_crossover) == {"Q4_1", "Q8_0"}
    assert all(rows >= 1 for rows in runner.quant_crossover.values())
    prompt = plain_english(default_model_dir)
    logits = {}
    for name, rows in (("kernel", 1 << 30), ("dequant", 1)):
        monkeypatch.setenv(crossover.ENV, str(rows))
        kernels.reset_crossover()
        logits[name] = prompt_logits(runner, prompt)
    diff = (logits["kernel"] - logits["dequant"]).abs() / logits["dequant"].std()
    agree = (logits["kernel"].argmax(-1) == logits["dequant"].argmax(-1)).float().mean().item()
    # measured on 193 tokens: 0.16 / 0.024 standard deviations largest / mean, 98% the same
    assert diff.max().item() < 0.5 and diff.mean().item() < 0.06 and agree >= 0.9, (
        diff.max().item(),
        diff.mean().item(),
        agree,
    )


def plain_english(model_dir) -> list[int]:
    """~100 tokens of plain English."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = " ".join(
        f"On day {i} the baker sold {3 * i % 17} loaves and {i % 5} cakes at the market."
        for i in range(5)
    )
    return tok.encode(text)
