"""The quantized-weight kernels (replica/layers/csrc/quant_gemm.c through replica/quant/kernels.py)
at every instruction-set level this CPU runs, for every block type, in both activation modes:

  - fp32 activations against gguf's de-quantizer and an fp64 matmul (the parity mode);
  - int8 activations against the same product with x quantized the kernels' way in torch
    (tight), and within a small error of the fp32 product;
  - de-quantized rows bitwise equal to gguf's;
ragged shapes (N not a multiple of anything, a last partial group of blocks of each size, M from
1 past the rows one pass serves), strided outputs, column-sliced weights, bias, bf16 x, the large-M
de-quantize + GEMM path, and the reference fallback without the native library. Q8_0 / Q4_0 /
Q4_1 weights come from gguf's quantizer; K-quant weights are random bytes with sane fp16 scales
(gguf has no K-quant quantizer, but de-quantizes them)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import quants

from replica.layers import cpu_isa, cpu_kernels
from replica.quant import crossover, kernels
from replica.quant.formats import BLOCK, QType, QuantizedTensor
from tests.replica.test_cpu_kernels import needs_native

pytestmark = needs_native

BLOCK32 = (QType.Q4_0, QType.Q4_1, QType.Q8_0)
KQUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
TYPES = BLOCK32 + KQUANTS
# (N, M, blocks per row): every N and M of the brief, last groups of 1-7 blocks and none; with
# AVX-512, whole groups of 16 blocks (zmm) with and without a rest, passes of 16, 8, 4, 1-3 rows
CASES = [
    (1, 1, 1),
    (7, 2, 2),
    (33, 3, 7),
    (257, 5, 8),
    (7, 16, 9),
    (33, 33, 18),
    (1, 130, 15),
    (257, 1, 31),
    (33, 5, 12),
    (9, 31, 32),
    (3, 9, 17),
]


def kernel_only(monkeypatch):
    """The kernel's own path at every M (not the de-quantize + GEMM path of large M)."""
    monkeypatch.setenv(crossover.ENV, str(1 << 30))
    monkeypatch.setattr(kernels, "_crossover", {})


# stepserve_quant_isa(): 0 scalar, 1 AVX2 maddubs, 2 its AVX-512 build, 3 AVX512-VNNI
PATH = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_vnni": 3, "avx512_bf16": 3}


@pytest.fixture(params=cpu_isa.runnable_levels())
def quant_level(request):
    """Every level this CPU runs: avx512 too where avx512_vnni runs (conftest's cpu_isa_level
    leaves it out there, as it differs from avx512_vnni only in these kernels)."""
    with cpu_isa.use_level(request.param):
        yield request.param


def make_weight(qtype: QType, n: int, k: int, seed: int) -> QuantizedTensor:
    rng = np.random.default_rng(seed)
    if qtype in BLOCK32:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        data = quants.quantize(w, qtype.value)
    else:
        elems, nbytes = BLOCK[qtype]
        data = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
        scale = (rng.random((n, k // elems)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
        if qtype == QType.Q6_K:
            data[:, :, 208:210] = scale.reshape(n, -1, 2)
        else:
            data[:, :, 0:2] = scale.reshape(n, -1, 2)
            dmin = (rng.random((n, k // elems)) * 0.01).astype(np.float16).view(np.uint8)
            data[:, :, 2:4] = dmin.reshape(n, -1, 2)
        data = data.reshape(n, -1)
    return QuantizedTensor(qtype, (n, k), torch.from_numpy(np.ascontiguousarray(data)))


def quantize_x_like_the_kernels(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the int8 kernels see it: int8 per group (32, or 256 for the K-quants) with the scale
    amax / 127, rounded half to even, de-quantized back to fp32."""
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = torch.round(g * inv)
    assert q.abs().max() <= 127
    return (q * d).reshape(m, k)


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


def scale_of(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, the sum of |x| |w|: what rounding errors of the products scale with."""
    return (x.abs().double() @ w.abs().double().T).float()


@pytest.fixture(scope="module")
def cases():
    """Per type: weights, x and the references, computed once for every level."""
    out = {}
    for ti, qtype in enumerate(TYPES):
        elems = BLOCK[qtype][0]
        group = 256 if qtype in KQUANTS else 32
        items = []
        for ci, (n, m, blocks) in enumerate(CASES):
            if qtype in KQUANTS:
                blocks = 1 + blocks % 4  # 256 to 1024 columns
            k = blocks * elems
            w = make_weight(qtype, n, k, seed=100 * ti + ci)
            gen = torch.Generator().manual_seed(ci)
            x = torch.randn(m, k, generator=gen)
            x[0, : min(k, 40)] *= 30  # an outlier: per-block scales matter
            wf = w.dequantize()
            items.append(
                (
                    w,
                    x,
                    wf,
                    product(x, wf),
                    product(quantize_x_like_the_kernels(x, group), wf),
                    scale_of(x, wf),
                )
            )
        out[qtype] = items
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_every_type_level_and_mode_against_the_references(qtype, cases, monkeypatch):
    kernel_only(monkeypatch)
    for level in cpu_isa.runnable_levels():
        with cpu_isa.use_level(level):
            assert cpu_kernels.native_library().stepserve_quant_isa() == PATH.get(level, 0)
            for w, x, _, ref32, ref8, scale in cases[qtype]:
                where = f"{level} {qtype.name} N={w.shape[0]} M={x.shape[0]} K={w.shape[1]}"
                y32 = kernels.quant_matmul(x, w, activations="fp32")
                torch.testing.assert_close(y32, ref32, rtol=0, atol=1e-5 * scale.max(), msg=where)
                y8 = kernels.quant_matmul(x, w, activations="int8")
                # the same int8 values as the torch reference: only fp32 rounding differs
                bound = 2e-6 * scale + 1e-6
                assert ((y8 - ref8).abs() <= bound).all(), f"{where}: int8 vs its reference"
                # and the int8 product stays close to the fp32 one (one scale per 256 for the
                # K-quants: an outlier costs more)
                err = (y8 - ref32).norm() / ref32.norm()
                assert err < (5e-2 if qtype in KQUANTS else 2e-2), (
                    f"{where}: int8 vs fp32 {err:.3g}"
                )


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantize_equals_gguf_bitwise(qtype, cases, quant_level):
    for w, _, wf, *_ in cases[qtype]:
        assert torch.equal(kernels.dequantize(w), wf)
        n = w.shape[0]
        ids = torch.tensor([n - 1, 0, n // 2, 0, n - 1])
        assert torch.equal(kernels.dequantize(w, ids), wf[ids])
        tokens = torch.tensor([[0, n - 1], [n // 3, n // 3]])  # embedding lookups of any shape
        assert torch.equal(kernels.dequantize(w, tokens), wf[tokens])
    with pytest.raises(RuntimeError, match="row id is out of range"):
        kernels.dequantize(w, torch.tensor([n]))


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q6_K], ids=lambda t: t.name)
def test_strided_output_column_slices_bias_and_bf16(qtype, quant_level, monkeypatch):
    kernel_only(monkeypatch)
    elems = BLOCK[qtype][0]
    k = 4 * elems
    w = make_weight(qtype, 37, k, seed=7)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(37, generator=gen)
    for act in kernels.ACTIVATIONS:
        for m in (1, 3, 6):
            x = torch.randn(m, k, generator=gen)
            plain = kernels.quant_matmul(x, w, activations=act)
            # bias, added in the kernel
            with_bias = kernels.quant_matmul(x, w, bias, activations=act)
            torch.testing.assert_close(with_bias, plain + bias, rtol=1e-6, atol=1e-6)
            # into a column slice of a wider output, rows of x strided too
            wide = torch.full((m, 50), 7.0)
            xs = torch.randn(m, k + 5, generator=gen)
            xs[:, :k] = x
            kernels.quant_matmul_out(xs[:, :k], w, wide[:, 5:42], activations=act)
            assert torch.equal(wide[:, 5:42], plain)
            assert (wide[:, :5] == 7).all() and (wide[:, 42:] == 7).all()
            # a column slice of the weight (whole blocks) takes its parent's row stride
            part = w.narrow(1, elems, 2 * elems)
            ref = kernels.quant_matmul(
                x[:, elems : 3 * elems].contiguous(), part.contiguous(), activations=act
            )
            torch.testing.assert_close(
                kernels.quant_matmul(x[:, elems : 3 * elems], part, activations=act), ref
            )
        # leading dimensions and bf16 x
        x3 = torch.randn(2, 3, k, generator=gen)
        y3 = kernels.quant_matmul(x3, w, activations=act)
        assert y3.shape == (2, 3, 37)
        torch.testing.assert_close(
            y3.reshape(6, 37), kernels.quant_matmul(x3.reshape(6, k), w, activations=act)
        )
        yb = kernels.quant_matmul(x3.bfloat16(), w, activations=act)
        assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, 37)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q5_K], ids=lambda t: t.name)
def test_large_m_takes_the_dequantize_gemm_path(qtype, monkeypatch):
    """From CROSSOVER_M rows the weight is de-quantized in tiles (several here) and torch's GEMM
    multiplies: the fp32 product of the de-quantized weight."""
    monkeypatch.setattr(kernels, "TILE_BYTES", 4 * 256 * 40)  # 40 rows of 256 columns a tile
    k = 256
    w = make_weight(qtype, 130, k, seed=11)
    wf = w.dequantize()
    bias = torch.randn(130)
    for act in kernels.ACTIVATIONS:
        x = torch.randn(kernels.crossover_m(qtype, act) + 3, k)
        y = kernels.quant_matmul(x, w, bias, activations=act)
        ref = product(x, wf) + bias
        # two GEMMs summing in different orders: fp32 rounding relative to the outputs' size
        scale = ref.abs().max().item()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6 * scale)


def test_reference_fallback_without_the_native_library(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "native_library", lambda level=None: None)
    monkeypatch.setattr(kernels, "_logged_fallback", False)
    assert not kernels.native_available()
    w = make_weight(QType.Q4_1, 9, 64, seed=1)
    x = torch.randn(2, 64)
    wf = w.dequantize()
    with caplog.at_level(logging.WARNING, logger="replica.quant.kernels"):
        for act in kernels.ACTIVATIONS:
            torch.testing.assert_close(kernels.quant_matmul(x, w, activations=act), x @ wf.T)
        assert torch.equal(kernels.dequantize(w, torch.tensor([3, 1])), wf[[3, 1]])
        assert torch.equal(kernels.dequantize(w), wf)
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


def test_float_weights_take_f_linear():
    data = torch.randn(5, 64)
    for qtype, dtype in (
        (QType.F32, torch.float32),
        (QType.F16, torch.float16),
        (QType.BF16, torch.bfloat16),
    ):
        w = QuantizedTensor(qtype, (5, 64), data.to(dtype).view(torch.uint8).reshape(5, -1))
        x = torch.randn(3, 64)
        torch.testing.assert_close(kernels.quant_matmul(x, w), x @ data.to(dtype).float().T)
        assert torch.equal(
            kernels.dequantize(w, torch.tensor([4, 0])), data.to(dtype).float()[[4, 0]]
        )


def test_bad_arguments_are_named():
    w = make_weight(QType.Q8_0, 4, 64, seed=2)
    with pytest.raises(ValueError, match="activations must be one of"):
        kernels.quant_matmul(torch.randn(1, 64), w, activations="int4")
    with pytest.raises(ValueError, match="x has 32 features, the weight 64"):
        kernels.quant_matmul(torch.randn(1, 32), w)


def test_the_library_compiles_at_every_level():
    """Every level's build compiles here, even one this CPU cannot run (compile only); each
    runnable one reports its own SIMD path."""
    compiler = cpu_kernels._compiler()
    for level in cpu_isa.levels():
        assert cpu_kernels._build(compiler, level).exists()
    for level in cpu_isa.runnable_levels():
        assert cpu_kernels.native_library(level).stepserve_quant_isa() == PATH.get(level, 0)


@pytest.mark.skipif(
    "avx512_vnni" not in cpu_isa.runnable_levels(), reason="this CPU has no AVX512-VNNI"
)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_vnni_gives_the_bits_of_maddubs(qtype, cases, monkeypatch):
    """VNNI's int8 dot products (avx512_vnni) are exact integer sums, as maddubs + madd's
    (avx512): the same outputs to the bit."""
    kernel_only(monkeypatch)
    for w, x, *_ in cases[qtype]:
        ys = {}
        for level in ("avx512", "avx512_vnni"):
            with cpu_isa.use_level(level):
                ys[level] = kernels.quant_matmul(x, w, activations="int8")
        assert torch.equal(ys["avx512"], ys["avx512_vnni"]), f"{qtype.name} {tuple(w.shape)}"


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q4_K], ids=lambda t: t.name)
def test_any_thread_count_gives_the_same_bits(qtype, monkeypatch):
    """Each output is one thread's sum in a fixed order: the thread count (and whether each
    thread quantizes x for itself: M <= 4) does not change a bit."""
    kernel_only(monkeypatch)
    elems = BLOCK[qtype][0]
    w = make_weight(qtype, 300, 3 * elems, seed=5)  # big enough to run in parallel
    saved = torch.get_num_threads()
    try:
        for m in (1, 3, 9):
            x = torch.randn(m, 3 * elems)
            for act in kernels.ACTIVATIONS:
                results = []
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    results.append(kernels.quant_matmul(x, w, activations=act))
                assert all(torch.equal(results[0], r) for r in results[1:]), (m, act)
    finally:
        torch.set_num_threads(saved)
