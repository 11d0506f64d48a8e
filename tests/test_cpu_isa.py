"""Instruction-set levels: decided from the CPU's flags, capped by STEPSERVE_CPU_ISA, and what
follows from them (which native build loads, whether oneDNN packs bf16 weights)."""

from __future__ import annotations

import logging

import pytest
import torch

from replica.layers import cpu_isa, cpu_kernels
from replica.layers.linear import onednn_available
from tests.test_cpu_kernels import needs_native

pytestmark = pytest.mark.skipif(not cpu_isa.is_x86(), reason="x86-64 levels")

AVX2_FLAGS = frozenset("sse2 ssse3 sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe popcnt".split())
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


def test_levels_come_from_the_cpu_flags():
    assert cpu_isa.detected_level(frozenset({"sse2"})) == "portable"
    assert cpu_isa.detected_level(AVX2_FLAGS) == "avx2"
    assert cpu_isa.detected_level(AVX2_FLAGS - {"fma"}) == "portable"
    assert cpu_isa.detected_level(AVX512_FLAGS) == "avx512"
    assert cpu_isa.detected_level(AVX512_FLAGS | {"avx512_bf16"}) == "avx512_bf16"
    # bf16 without the AVX-512 base is not the bf16 level
    assert cpu_isa.detected_level(AVX2_FLAGS | {"avx512_bf16"}) == "avx2"
    assert cpu_isa.missing_flags("avx512", AVX2_FLAGS) == [
        "avx512bw",
        "avx512cd",
        "avx512dq",
        "avx512f",
        "avx512vl",
    ]
    assert cpu_isa.missing_flags("avx2", AVX512_FLAGS) == []


def test_bf16_packing_needs_avx512_or_avx_ne_convert():
    assert not cpu_isa.onednn_bf16_packing("avx2", AVX2_FLAGS)
    assert cpu_isa.onednn_bf16_packing("avx2", AVX2_FLAGS | {"avx_ne_convert"})
    assert not cpu_isa.onednn_bf16_packing("portable", AVX2_FLAGS | {"avx_ne_convert"})
    assert cpu_isa.onednn_bf16_packing("avx512", AVX512_FLAGS)
    # an AVX-512 CPU capped at avx2 packs fp32 only, as an AVX2 CPU would
    assert not cpu_isa.onednn_bf16_packing("avx2", AVX512_FLAGS)


def test_the_cap_lowers_the_level_and_names_a_bad_value(monkeypatch):
    detected = cpu_isa.detected_level()
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    assert cpu_isa.active_level() == detected
    monkeypatch.setenv(cpu_isa.ISA_ENV, "portable")
    assert cpu_isa.active_level() == "portable"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "AVX512_BF16")  # a cap above the CPU is the CPU
    assert cpu_isa.active_level() == detected
    monkeypatch.setenv(cpu_isa.ISA_ENV, "auto")
    assert cpu_isa.active_level() == detected
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=r"STEPSERVE_CPU_ISA='avx3' is not one of: auto, portable"):
        cpu_isa.active_level()


def test_use_level_refuses_a_level_the_cpu_cannot_run():
    if cpu_isa.detected_level() == "avx512_bf16":
        pytest.skip("this CPU runs every level")
    with pytest.raises(ValueError, match="this CPU cannot run level 'avx512_bf16': it lacks"):
        cpu_isa.use_level("avx512_bf16")


def test_packing_follows_the_level():
    w32 = torch.randn(8, 8)
    w16 = w32.bfloat16()
    for level in cpu_isa.runnable_levels():
        with cpu_isa.use_level(level):
            assert onednn_available(w32) == torch.backends.mkldnn.is_available()
            assert onednn_available(w16) == (
                torch.backends.mkldnn.is_available() and cpu_isa.onednn_bf16_packing(level)
            )
            if onednn_available(w16):  # what it allows, oneDNN does
                torch.ops.mkldnn._reorder_linear_weight(w16)


def test_the_choice_is_logged_once_per_level(caplog):
    cpu_isa._logged.clear()
    with caplog.at_level(logging.INFO, logger="replica.layers.cpu_isa"):
        cpu_isa.log_choice("portable")
        cpu_isa.log_choice("portable")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "'portable'" in lines[0] and "-march=x86-64" in lines[0]
    assert "fp32 only" in lines[0]


@needs_native
def test_every_level_compiles_here_and_runnable_ones_load():
    """The AVX-512 sources compile on any x86-64 host (built, not run, where the CPU lacks
    them); each runnable level loads its own build, with its own -march."""
    compiler = cpu_kernels._compiler()
    paths = {level: cpu_kernels._build(compiler, level) for level in cpu_isa.levels()}
    assert len(set(paths.values())) == len(paths)  # one build per level
    for level in cpu_isa.runnable_levels():
        lib = cpu_kernels.native_library(level)
        assert lib is not None and lib._name == str(paths[level])
    for level in set(cpu_isa.levels()) - set(cpu_isa.runnable_levels()):
        with pytest.raises(ValueError, match="which this CPU lacks"):
            cpu_kernels.native_library(level)
