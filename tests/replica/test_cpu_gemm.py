"""The CPU linear layers' packed GEMMs (replica/layers/cpu_gemm.py): MKL's packed sgemm for fp32
on Intel CPUs (oneDNN's on others), oneDNN for bf16 where the level allows, row-major otherwise;
every path gives F.linear's results, and the path is chosen per dtype and instruction-set level
and recorded per layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replica.layers import cpu_gemm, cpu_isa
from replica.layers.linear import ColumnParallelLinear, TensorParallel
from tests.replica.test_model_parity import expected_outputs, mixed_prompts

ROOT = Path(__file__).resolve().parents[2]
needs_mkl = pytest.mark.skipif(cpu_gemm.mkl_library() is None, reason="torch without MKL")


@needs_mkl
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 17, 64, 513])
def test_mkl_packed_linear_matches_f_linear(rows):
    """Any row count runs from one packing (packed for PACK_ROWS_HINT rows), with and without
    a bias, from a strided input and with leading dimensions."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 80), torch.randn(96)
    packed = cpu_gemm.mkl_pack(weight)
    x = torch.randn(rows, 160)[:, ::2]  # not contiguous
    torch.testing.assert_close(
        cpu_gemm.mkl_linear(x, packed, 96, None), F.linear(x, weight), rtol=1e-5, atol=1e-4
    )
    torch.testing.assert_close(
        cpu_gemm.mkl_linear(x, packed, 96, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4
    )
    x3 = torch.randn(2, rows, 80)
    assert cpu_gemm.mkl_linear(x3, packed, 96, None).shape == (2, rows, 96)


def test_fp32_goes_to_mkl_on_intel_and_to_onednn_elsewhere():
    """auto: MKL on GenuineIntel, oneDNN on other vendors (MKL is 1.2-2.7x oneDNN's time on an
    AMD EPYC), each falling back to the other where torch lacks it; an override wins."""
    choose = cpu_gemm.choose_fp32
    assert choose("auto", "GenuineIntel", True, True) == "mkl"
    assert choose("auto", "AuthenticAMD", True, True) == "onednn"
    assert choose("auto", "", True, True) == "onednn"
    assert choose("auto", "GenuineIntel", False, True) == "onednn"
    assert choose("auto", "AuthenticAMD", True, False) == "mkl"
    assert choose("mkl", "AuthenticAMD", True, True) == "mkl"
    assert choose("onednn", "GenuineIntel", True, True) == "onednn"
    assert choose("mkl", "GenuineIntel", False, True) == "onednn"
    assert choose("auto", "GenuineIntel", False, False) is None


def test_the_path_follows_the_dtype_the_level_and_the_override(monkeypatch):
    w32, w16 = torch.randn(8, 8), torch.randn(8, 8).bfloat16()
    monkeypatch.delenv(cpu_gemm.GEMM_ENV, raising=False)
    fp32 = cpu_gemm.fp32_packing()  # auto: this CPU's vendor (the choice itself: test above)
    for level in cpu_isa.runnable_levels():
        with cpu_isa.use_level(level):
            assert cpu_gemm.packing_for(w32) == fp32
            bf16 = cpu_isa.onednn_bf16_packing(level) and torch.backends.mkldnn.is_available()
            assert cpu_gemm.packing_for(w16) == ("onednn" if bf16 else None)
    assert cpu_gemm.packing_for(torch.randn(8, 8).half()) is None
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "onednn")
    assert cpu_gemm.packing_for(w32) == "onednn"
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, " ")
    assert cpu_gemm.gemm_choice() == "auto" and cpu_gemm.packing_for(w32) == fp32
    monkeypatch.setenv(cpu_gemm.GEMM_ENV, "blas")
    with pytest.raises(ValueError, match=r"STEPSERVE_CPU_GEMM='blas' is not one of: auto, mkl"):
        cpu_gemm.packing_for(w32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_layer_records_its_path_and_keeps_f_linear_results(dtype, monkeypatch):
    for gemm in ("auto", "onednn", "mkl"):  # each path on any host
        monkeypatch.setenv(cpu_gemm.GEMM_ENV, gemm)
        torch.manual_seed(0)
        layer = ColumnParallelLinear(64, 48, True, TensorParallel())
        layer.weight.data.copy_(torch.randn(48, 64))
        layer.bias.data.copy_(torch.randn(48))
        layer.to(dtype)
        weight = layer.weight.detach().clone()
        x = torch.randn(5, 64, dtype=dtype)
        expected = F.linear(x, weight, layer.bias)
        packing = cpu_gemm.packing_for(weight)
        assert layer.pack_weights() == (packing is not None)
        assert layer.packing == packing
        if packing is not None:
            assert layer.weight.numel() == 0 and layer.packed_nbytes == weight.nbytes
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(x), expected, rtol=tol, atol=tol)


# ISA caps of the libraries at each level: oneDNN's, MKL's and ATen's kernels then run as they
# would on a CPU whose best level that is (each read once, at the library's first use);
# avx512_bf16 caps oneDNN below AMX, so an AMX host runs its AVX512-BF16 path too
LIBRARY_CAPS = {
    "portable": ("SSE41", "SSE4_2", "default"),
    "avx2": ("AVX2", "AVX2", "avx2"),
    "avx512": ("AVX512_CORE", "AVX512", "avx512"),
    "avx512_vnni": ("AVX512_CORE_VNNI", "AVX512", "avx512"),
    "avx512_bf16": ("AVX512_CORE_BF16", "AVX512", "avx512"),
}
_ENGINE_SCRIPT = """
import json, sys
from replica.engine import LLM
from replica.request import SamplingParams
from replica.layers.linear import PackableLinear
model_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
result = {}
for dtype in ("float32", "bfloat16"):
    llm = LLM(model_dir, dtype=dtype, block_size=4, kv_cache_bytes=1 << 24)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params)
    runner = llm.engine.runner
    packings = sorted({m.packing or "row-major" for m in runner.model.modules()
                       if isinstance(m, PackableLinear)})
    result[dtype] = {"level": runner.cpu_isa, "packings": packings,
                     "tokens": [o.output_token_ids for o in outs]}
    llm.shutdown()
print(json.dumps(result))
"""


def _capped_levels() -> list[str]:
    """The levels below this CPU's own (its own runs in-process: the cpu_isa_level fixture),
    and its own where it has AMX, which the avx512_bf16 cap turns off in oneDNN; as the fixture,
    avx512 not where avx512_vnni runs (cpu_isa.levels_to_test)."""
    if not cpu_isa.is_x86():
        return []
    runnable = cpu_isa.levels_to_test()
    amx = {"amx_bf16", "amx_tile"} <= cpu_isa.cpu_flags()
    return [lv for lv in runnable if lv != cpu_isa.detected_level() or amx]


@pytest.mark.parametrize("level", _capped_levels())
def test_a_capped_process_matches_transformers(level, tiny_qwen2_dir):
    """A process capped at a lower level, our kernels and oneDNN's / MKL's / ATen's alike (a
    fresh process: the libraries read their caps once), gives transformers' greedy fp32 tokens
    from the packed GEMM the level chose (QKV bias, tied LM head); bf16 runs from oneDNN's
    packing where the level allows it, row-major below."""
    prompts = mixed_prompts(11, [3, 21, 40])
    max_tokens = [6, 5, 7]
    onednn, mkl, aten = LIBRARY_CAPS[level]
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": onednn,
        "MKL_ENABLE_INSTRUCTIONS": mkl,
        "ATEN_CPU_CAPABILITY": aten,
        cpu_isa.ISA_ENV: level,
        "PYTHONPATH": str(ROOT),
    }
    env.pop(cpu_gemm.GEMM_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE_SCRIPT, str(tiny_qwen2_dir)]
        + [json.dumps(prompts), json.dumps(max_tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    fp32, bf16 = result["float32"], result["bfloat16"]
    assert fp32["level"] == bf16["level"] == level
    assert fp32["packings"] == [cpu_gemm.fp32_packing()]
    assert fp32["tokens"] == expected_outputs(tiny_qwen2_dir, prompts, max_tokens)
    bf16_packed = torch.backends.mkldnn.is_available() and cpu_isa.onednn_bf16_packing(level)
    assert bf16["packings"] == ["onednn" if bf16_packed else "row-major"]
    assert [len(t) for t in bf16["tokens"]] == max_tokens
