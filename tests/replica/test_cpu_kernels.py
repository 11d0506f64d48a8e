"""The native paged decode kernel against torch's SDPA over explicitly gathered K/V: shuffled
block tables, GQA groups, head sizes that are and are not multiples of the vector width,
lengths on and off block boundaries, fp32 and bf16, any thread count."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from replica.layers.cpu_kernels import DISABLE_ENV, _compiler, paged_decode, paged_decode_kernel

# Where the native kernels can run: a C compiler, and not turned off for the process.
NATIVE_POSSIBLE = _compiler() is not None and os.environ.get(DISABLE_ENV, "1") != "0"
needs_native = pytest.mark.skipif(
    not NATIVE_POSSIBLE, reason=f"no C compiler on this machine, or {DISABLE_ENV}=0"
)
pytestmark = needs_native


@pytest.fixture(autouse=True)
def every_level(cpu_isa_level):
    """Every test here runs once per instruction-set level this CPU can execute."""
    return cpu_isa_level


def reference(q, k_cache, v_cache, block_table, seq_lens, scale):
    block_size = k_cache.shape[1]
    out = torch.empty_like(q, dtype=torch.float32)
    for i, n in enumerate(seq_lens.tolist()):
        keys = torch.arange(n)
        blocks = block_table[i].long()[keys // block_size]
        k = k_cache[blocks, keys % block_size].float().transpose(0, 1)  # [kv_heads, n, d]
        v = v_cache[blocks, keys % block_size].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[i].float()[:, None, :], k, v, scale=scale, enable_gqa=True
        )
        out[i] = o[:, 0, :]
    return out


def case(seed, num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [
        rng.choice([1, block_size, block_size + 1, rng.randrange(1, 200)]) for _ in range(num_seqs)
    ]
    table, k, v = scattered_cache(
        rng, gen, [-(-n // block_size) for n in lens], 7, 2, block_size, num_kv_heads, head_dim,
        dtype,
    )  # fmt: skip
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def scattered_cache(
    rng, gen, blocks_per, spare_blocks, spare_columns, block_size, num_kv_heads, head_dim, dtype
):
    """A random K/V pool and a block table giving each request its blocks scattered over the
    pool, as after churn (`spare_blocks` unused in the pool, `spare_columns` unused per row)."""
    num_blocks = sum(blocks_per) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    table = torch.zeros(len(blocks_per), max(blocks_per) + spare_columns, dtype=torch.int32)
    cursor = 0
    for i, b in enumerate(blocks_per):
        table[i, :b] = torch.tensor(ids[cursor : cursor + b], dtype=torch.int32)
        cursor += b
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return table, k, v


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    # 272: past the vector path's 256, so the portable per-sequence path runs too
    [(9, 3, 64, 16), (4, 4, 32, 4), (8, 2, 24, 8), (2, 1, 80, 1), (2, 1, 272, 4)],
)
@pytest.mark.parametrize("threads", [1, 2, 64])
def test_fp32_kernel_matches_sdpa_over_gathered_blocks(
    num_heads, num_kv_heads, head_dim, block_size, threads
):
    q, k, v, table, lens = case(
        threads, 13, num_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    scale = head_dim**-0.5
    got = paged_decode(q, k, v, table, lens, scale, num_threads=threads)
    want = reference(q, k, v, table, lens, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bf16_kernel_matches_sdpa_within_bf16_rounding():
    q, k, v, table, lens = case(7, 11, 9, 3, 64, 16, torch.bfloat16)
    got = paged_decode(q, k, v, table, lens, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), reference(q, k, v, table, lens, 0.125), atol=2e-2, rtol=2e-2
    )


def test_kernel_is_built_once_and_rejects_bad_inputs():
    assert paged_decode_kernel() is not None
    assert paged_decode_kernel() is paged_decode_kernel()
    q, k, v, table, lens = case(1, 3, 4, 2, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_decode(q, k, v, table[:, :1], lens + 50, 1.0)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        paged_decode(q.double(), k.double(), v.double(), table, lens, 1.0)
    with pytest.raises(ValueError, match="do not group"):
        paged_decode(torch.randn(3, 3, 32), k, v, table, lens, 1.0)
    assert paged_decode(q[:0], k, v, table[:0], lens[:0], 1.0).shape == (0, 4, 32)


def test_loading_the_kernel_keeps_subnormal_floats_in_this_process():
    """A shared library linked with -ffast-math would set flush-to-zero for the whole process
    when it loads; torch and Python arithmetic must be untouched."""
    assert paged_decode_kernel() is not None
    tiny = float("5e-324")  # the smallest subnormal double
    assert tiny * 3 > 0
    sub = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in fp32
    assert float(sub * 2) > 0
    q, k, v, table, lens = case(2, 2, 2, 1, 16, 4, torch.float32)
    paged_decode(q, k, v, table, lens, 1.0)
    assert tiny * 3 > 0 and float(sub * 2) > 0


def test_kernel_threads_come_from_torchs_openmp_runtime():
    """Built with OpenMP, the library must bind to the libgomp torch already loaded (one
    runtime, one pool of threads): a second runtime would put two spinning pools on the
    same cores."""
    assert paged_decode_kernel() is not None
    q, k, v, table, lens = case(3, 8, 4, 2, 32, 4, torch.float32)
    paged_decode(q, k, v, table, lens, 1.0, num_threads=2)
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libgomp" in line}
    # vendored copies under a hashed name (libgomp-1a2b3c.so, e.g. sentencepiece's) are private
    # to their package; the kernels' libgomp.so.1 must be the one already loaded
    runtimes = {p for p in paths if os.path.basename(p).startswith("libgomp.so")}
    assert len(runtimes) <= 1, runtimes


# -- fused elementwise ops ----------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 5, 130])  # 130: split over threads
def test_fused_norms_and_silu_match_torch(rows):
    from replica.layers.cpu_kernels import rms_norm, silu_mul

    gen = torch.Generator().manual_seed(rows)
    hidden = 72  # not a multiple of the 16 lanes
    x = torch.randn(rows, hidden, generator=gen)
    residual = torch.randn(rows, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5

    def ref_norm(t):
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(rms_norm(x, weight, 1e-5), ref_norm(x), atol=1e-6, rtol=1e-5)
    expected_sum = residual + x
    got = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, expected_sum)  # the residual stream updated in place, exactly
    torch.testing.assert_close(got, ref_norm(expected_sum), atol=1e-6, rtol=1e-5)

    gate_up = torch.randn(rows, 2 * 40, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="last dimension"):
        rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(ValueError, match="fp32"):
        silu_mul(gate_up.double())


@pytest.mark.parametrize("inter", [40, 1536])  # 40: a tail shorter than the 16 lanes
def test_silu_mul_within_a_few_ulps_at_every_level(inter, cpu_isa_level):
    """fp32 SiLU * up against a float64 reference, over every range the exponential meets:
    beyond +-87 (saturated), around 0, and the model-like bulk; AVX-512 computes it with its
    own exponential and reciprocal (csrc/fused_ops.c), the other levels with expf."""
    from replica.layers.cpu_kernels import silu_mul

    gen = torch.Generator().manual_seed(inter)
    gate = torch.cat(
        [torch.linspace(-120, 120, 241), torch.tensor([0.0, -0.0, 1e-30, -1e-30]),
         torch.randn(8 * inter, generator=gen) * 4]
    )  # fmt: skip
    gate = gate[: (gate.numel() // inter) * inter].view(-1, inter)
    up = torch.randn(gate.shape, generator=gen)
    got = silu_mul(torch.cat([gate, up], dim=-1))
    want = (gate.double() * torch.sigmoid(gate.double()) * up.double()).float()
    # a few ulps of the result (the products round twice); below -87 the AVX-512 exponential is
    # 0, so g * sigmoid(g) there (under 1e-35 in magnitude) comes out 0
    torch.testing.assert_close(got, want, atol=1e-35, rtol=6e-7)


def test_kv_write_matches_index_copy():
    """The step's K/V rows (strided views of the qkv rows) into their cache slots by one C call,
    as two index_copy_ calls place them; a slot outside the cache is refused before anything is
    written; tensors it cannot take are left to the caller."""
    from replica.layers.cpu_kernels import kv_write

    gen = torch.Generator().manual_seed(0)
    kv_heads, d, rows = 2, 8, 300  # 300: split over threads
    qkv = torch.randn(rows, (4 + 2 * kv_heads) * d, generator=gen)
    k = qkv[:, 4 * d : (4 + kv_heads) * d].view(rows, kv_heads, d)
    v = qkv[:, (4 + kv_heads) * d :].view(rows, kv_heads, d)
    slots = torch.randperm(64 * 16, generator=gen)[:rows]
    caches = [torch.zeros(64, 16, kv_heads, d) for _ in range(4)]
    assert kv_write(k, v, slots, caches[0], caches[1])
    caches[2].view(-1, kv_heads, d).index_copy_(0, slots, k)
    caches[3].view(-1, kv_heads, d).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    bad = slots.clone()
    bad[-1] = 64 * 16
    fresh = [torch.zeros(64, 16, kv_heads, d) for _ in range(2)]
    with pytest.raises(IndexError, match="0..1023"):
        kv_write(k, v, bad, *fresh)
    assert not fresh[0].any() and not fresh[1].any()
    assert not kv_write(k.double(), v.double(), slots, *fresh)  # not a kernel dtype
    assert not kv_write(k, v, slots.int(), *fresh)  # int32 slots: index_copy_ takes those
    assert not kv_write(k[:2], v[:2], slots[:2], *fresh)  # a decode step's few rows


@pytest.mark.parametrize("rows", [3, 70])
def test_fused_rotary_is_bitwise_the_torch_rotation(rows):
    """In place on the query and key heads at the start of strided qkv rows; the value heads
    after them untouched."""
    from replica.layers.rotary import RotaryEmbedding

    head_dim, q_heads, kv_heads = 32, 4, 2
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 512, (rows,), generator=gen)
    qk_width = (q_heads + kv_heads) * head_dim
    expected = rotary.rotate(positions, qkv[:, :qk_width].reshape(rows, -1, head_dim))
    values = qkv[:, qk_width:].clone()
    rotary.rotate_(positions, qkv, q_heads + kv_heads)
    assert torch.equal(qkv[:, :qk_width], expected.reshape(rows, qk_width))
    assert torch.equal(qkv[:, qk_width:], values)
    with pytest.raises(ValueError, match="beyond the rotary table"):
        rotary.rotate_(positions + 512, qkv, q_heads + kv_heads)


@pytest.mark.parametrize("rows", [2, 66])
def test_fused_ops_in_bf16_round_where_torch_rounds(rows):
    """bf16: the residual sum, the rotary and SiLU*up are bitwise torch's bf16 ops; the norm
    (its fp32 reduction in another order) within one bf16 ulp."""
    from replica.layers.cpu_kernels import rms_norm, silu_mul
    from replica.layers.norm import RMSNorm
    from replica.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(rows)
    bf = torch.bfloat16
    hidden = 48
    norm = RMSNorm(hidden, 1e-5).to(bf)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(bf)
    x = torch.randn(rows, hidden, generator=gen).to(bf)
    residual = torch.randn(rows, hidden, generator=gen).to(bf)
    want, want_sum = norm(x, residual.clone())  # torch ops (fused_cpu_ops off)
    got = rms_norm(x, norm.weight, 1e-5, residual)
    assert torch.equal(residual, want_sum)
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)

    gate_up = (torch.randn(rows, 64, generator=gen) * 3).to(bf)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul(gate_up), F.silu(gate) * up)

    rotary = RotaryEmbedding(16, 256)
    qkv = torch.randn(rows, 5 * 16, generator=gen).to(bf)
    positions = torch.randint(0, 256, (rows,), generator=gen)
    expected = rotary.rotate(positions, qkv[:, :48].reshape(rows, 3, 16)).reshape(rows, 48)
    rotary.rotate_(positions, qkv, 3)
    assert torch.equal(qkv[:, :48], expected)


def test_decode_batch_checks_once_what_the_unchecked_kernel_trusts():
    """The layers call the kernel unchecked; the per-step metadata refuses a decode whose length
    runs past its block table (the kernel would read outside the cache)."""
    from replica.layers.attention.native_decode import _decode_batch

    table = torch.tensor([[3, 4], [5, 6]])
    starts = torch.tensor([0, 1])
    batch = _decode_batch([1, 1], [8, 5], table, 4, starts, "cpu")
    assert batch.block_table.dtype == torch.int32 and batch.block_table.is_contiguous()
    assert batch.seq_lens.tolist() == [8, 5] and batch.all_tokens
    with pytest.raises(ValueError, match="longer than its block table"):
        _decode_batch([1, 1], [9, 5], table, 4, starts, "cpu")
