"""Instruction-set levels: decided from the CPU's flags, capped by STEPSERVE_CPU_ISA, and what
follows from them (which native build loads, whether oneDNN packs bf16 weights)."""

from __future__ import annotations

import logging

import pytest
import torch

from replica.layers import cpu_isa, cpu_kernels
from replica.layers.linear import onednn_available
from tests.replica.test_cpu_kernels import needs_native

pytestmark = pytest.mark.skipif(not cpu_isa.is_x86(), reason="x86-64 levels")

AVX2_FLAGS = frozenset("sse2 ssse3 sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe popcnt".split())
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
VNNI_FLAGS = AVX512_FLAGS | {"avx512_vnni"}


def test_levels_come_from_the_cpu_flags():
    assert cpu_isa.detected_level(frozenset({"sse2"})) == "portable"
    assert cpu_isa.detected_level(AVX2_FLAGS) == "avx2"
    assert cpu_isa.detected_level(AVX2_FLAGS - {"fma"}) == "portable"
    assert cpu_isa.detected_level(AVX512_FLAGS) == "avx512"
    assert cpu_isa.detected_level(VNNI_FLAGS) == "avx512_vnni"  # Cascade Lake, Ice Lake
    assert cpu_isa.detected_level(VNNI_FLAGS | {"avx512_bf16"}) == "avx512_bf16"
    # the bf16 level sits on the VNNI one (the quantized kernels' vpdpbusd path)
    assert cpu_isa.detected_level(AVX512_FLAGS | {"avx512_bf16"}) == "avx512"
    assert cpu_isa.detected_level(AVX2_FLAGS | {"avx512_vnni"}) == "avx2"
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
    assert cpu_isa.missing_flags("avx512_bf16", AVX512_FLAGS) == ["avx512_bf16", "avx512_vnni"]
    assert cpu_isa.missing_flags("avx512_bf16", VNNI_FLAGS) == ["avx512_bf16"]


def test_vnni_is_its_own_build_and_changes_nothing_else(monkeypatch):
    """avx512_vnni builds with VNNI (avx512_bf16 keeps it, avx512 has none); oneDNN packing and
    the attention paths are avx512's; the shared level fixture runs it in avx512's place."""
    from replica.layers.attention import native_decode

    assert "-mavx512vnni" in cpu_isa.march_flags("avx512_vnni")
    assert "-mavx512vnni" in cpu_isa.march_flags("avx512_bf16")
    assert not any("vnni" in f for f in cpu_isa.march_flags("avx512"))
    assert cpu_isa.onednn_bf16_packing("avx512_vnni", VNNI_FLAGS)
    assert native_decode.native_prefill_max_keys("avx512_vnni") is None
    assert "avx512_vnni" in native_decode.VECTOR_PREFILL_LEVELS
    for flags, tested in (
        (AVX512_FLAGS, ("portable", "avx2", "avx512")),
        (VNNI_FLAGS, ("portable", "avx2", "avx512_vnni")),
        (VNNI_FLAGS | {"avx512_bf16"}, ("portable", "avx2", "avx512_vnni", "avx512_bf16")),
    ):
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu_isa.levels_to_test() == tested


def test_bf16_packing_needs_avx512_or_avx_ne_convert():
    assert not cpu_isa.onednn_bf16_packing("avx2", AVX2_FLAGS)
    assert cpu_isa.onednn_bf16_packing("avx2", AVX2_FLAGS | {"avx_ne_convert"})
    assert not cpu_isa.onednn_bf16_packing("portable", AVX2_FLAGS | {"avx_ne_convert"})
    assert cpu_isa.onednn_bf16_packing("avx512", AVX512_FLAGS)
    # an AVX-512 CPU capped at avx2 packs fp32 only, as an AVX2 CPU would
    assert not cpu_isa.onednn_bf16_packing("avx2", AVX512_FLAGS)


def test_the_cap_lowers_the_level_and_names_a_bad_value():
    detected = cpu_isa.detected_level()
    env = cpu_isa.ISA_ENV
    assert cpu_isa.level_from_env({}) == detected
    assert cpu_isa.level_from_env({env: "portable"}) == "portable"
    # a cap above the CPU is the CPU
    assert cpu_isa.level_from_env({env: "AVX512_BF16"}) == detected
    assert cpu_isa.level_from_env({env: "auto"}) == detected
    with pytest.raises(ValueError, match=r"STEPSERVE_CPU_ISA='avx3' is not one of: auto, portable"):
        cpu_isa.level_from_env({env: "avx3"})


def test_use_level_is_per_thread_and_nests():
    import threading

    outside = cpu_isa.active_level()
    seen = {}
    with cpu_isa.use_level("portable"):
        thread = threading.Thread(target=lambda: seen.setdefault("other", cpu_isa.active_level()))
        thread.start()
        thread.join()
        with cpu_isa.use_level(cpu_isa.detected_level()):
            assert cpu_isa.active_level() == cpu_isa.detected_level()
        assert cpu_isa.active_level() == "portable"
    assert cpu_isa.active_level() == outside
    assert seen["other"] == outside  # another thread keeps the process's level


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
        cpu_isa.log_choice("portable", "mkl")
        cpu_isa.log_choice("portable", "mkl")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "'portable'" in lines[0] and "-march=x86-64" in lines[0]
    assert "bf16 weights stay row-major" in lines[0] and "fp32 weights packed for" in lines[0]


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


def test_an_engine_field_caps_the_level_of_its_runner(tiny_llama_dir, run_generation, monkeypatch):
    """EngineConfig.cpu_isa caps one engine's level (the same job as STEPSERVE_CPU_ISA, per
    engine): every native kernel call of its forward runs at it, the caller's level is left
    alone, and its greedy tokens are those of the CPU's own level."""
    from tests.replica.test_model_parity import greedy_params, mixed_prompts

    seen = []
    real = cpu_kernels.native_library

    def recording(level=None):
        seen.append(cpu_isa.active_level() if level is None else level)
        return real(level)

    monkeypatch.setattr(cpu_kernels, "native_library", recording)
    prompts = mixed_prompts(3, [5, 17, 33])
    capped = run_generation(
        tiny_llama_dir, prompts, greedy_params(8), block_size=4, cpu_isa="portable"
    )
    assert capped.runner.cpu_isa == "portable"
    assert seen and set(seen) == {"portable"}
    assert cpu_isa.active_level() == cpu_isa.level_from_env()  # the caller's level is untouched
    own = run_generation(tiny_llama_dir, prompts, greedy_params(8), block_size=4)
    assert own.runner.cpu_isa == cpu_isa.active_level()
    assert capped.outputs == own.outputs
