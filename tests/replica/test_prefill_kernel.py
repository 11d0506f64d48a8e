"""The native tiled prefill kernel (csrc/paged_prefill.c) against torch's causal SDPA over
explicitly gathered K/V: whole prompts, chunks after cached context (chunked prefill, prefix
hits), several spans in one call, shuffled block tables, GQA groups, head sizes on and off the
vector width and the specialised 64/128, lengths on and off the tile size, fp32 and bf16, any
thread count, at every instruction-set level this CPU runs."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from replica.layers.cpu_kernels import paged_prefill
from tests.replica.test_cpu_kernels import needs_native, scattered_cache

pytestmark = needs_native


@pytest.fixture(autouse=True)
def every_level(cpu_isa_level):
    return cpu_isa_level


def reference(q, k_cache, v_cache, table, q_starts, q_lens, ctx_starts, scale):
    """Each span's queries [n] at positions ctx..ctx+n-1 against its keys 0..ctx+n-1 (bottom-
    right causal), gathered, in fp32."""
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for s, (q0, n, ctx) in enumerate(zip(q_starts.tolist(), q_lens.tolist(), ctx_starts.tolist())):
        keys = torch.arange(ctx + n)
        blocks = table[s].long()[keys // block_size]
        k = k_cache[blocks, keys % block_size].float().transpose(0, 1)  # [kv_heads, keys, d]
        v = v_cache[blocks, keys % block_size].float().transpose(0, 1)
        mask = torch.ones(n, ctx + n, dtype=torch.bool).tril(diagonal=ctx)
        o = F.scaled_dot_product_attention(
            q[q0 : q0 + n].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        out[q0 : q0 + n] = o.transpose(0, 1)
    return out


def spans_case(seed, spans, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """`spans`: (context before, query tokens) per span."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    table, k, v = scattered_cache(
        rng, gen, [-(-(ctx + n) // block_size) for ctx, n in spans], 5, 1, block_size,
        num_kv_heads, head_dim, dtype,
    )  # fmt: skip
    lens = torch.tensor([n for _, n in spans], dtype=torch.int32)
    starts = torch.cumsum(lens, 0, dtype=torch.int32) - lens
    ctx = torch.tensor([c for c, _ in spans], dtype=torch.int32)
    q = torch.randn(int(lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, table, starts, lens, ctx


SPANS = [
    [(0, 146)],  # a whole prompt, off the tile size
    [(0, 16), (0, 1), (0, 33)],  # several prompts; one of a single token
    [(37, 20), (64, 64), (5, 3)],  # chunks after context: an earlier chunk or a prefix hit
]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 24, 4), (2, 1, 80, 1), (3, 3, 32, 16)],
)
@pytest.mark.parametrize("spans", SPANS, ids=["prompt", "prompts", "chunks"])
def test_fp32_prefill_matches_causal_sdpa(num_heads, num_kv_heads, head_dim, block_size, spans):
    case = spans_case(len(spans), spans, num_heads, num_kv_heads, head_dim, block_size,
                      torch.float32)  # fmt: skip
    scale = head_dim**-0.5
    got = paged_prefill(*case, scale, num_threads=2)
    torch.testing.assert_close(got, reference(*case, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 3, 64])  # 64: more workers than tiles
def test_any_thread_count_gives_the_same_rows(threads):
    case = spans_case(9, SPANS[2], 9, 3, 64, 16, torch.float32)
    got = paged_prefill(*case, 0.125, num_threads=threads)
    torch.testing.assert_close(got, reference(*case, 0.125), atol=2e-5, rtol=1e-4)


def test_query_rows_read_in_place_from_a_wider_row():
    """q as the engine passes it: the query heads at the start of each token's qkv row (a
    strided view), read without a copy, give the rows a contiguous q gives."""
    q, k, v, table, starts, lens, ctx = spans_case(5, SPANS[2], 9, 3, 64, 16, torch.float32)
    wide = torch.randn(q.shape[0], 9 * 64 + 2 * 3 * 64)
    wide[:, : 9 * 64] = q.reshape(q.shape[0], -1)
    view = wide[:, : 9 * 64].view(q.shape)
    assert not view.is_contiguous()
    got = paged_prefill(view, k, v, table, starts, lens, ctx, 0.125)
    assert got.is_contiguous()
    torch.testing.assert_close(got, paged_prefill(q, k, v, table, starts, lens, ctx, 0.125))
    torch.testing.assert_close(got, reference(q, k, v, table, starts, lens, ctx, 0.125),
                               atol=2e-5, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_keys_past_the_tile_cache(threads):
    """A worker keeps a span's first 2 MiB of key and value tiles (2048 keys at head size 128);
    keys past them go through a slot refilled at each use. Spans on both sides of it, and two
    spans of one step, each worker moving between them and between KV heads."""
    spans = [(2030, 70), (0, 100), (2100, 20)]
    case = spans_case(7, spans, 4, 2, 128, 16, torch.float32)
    got = paged_prefill(*case, 128**-0.5, num_threads=threads)
    torch.testing.assert_close(got, reference(*case, 128**-0.5), atol=2e-5, rtol=1e-4)


def test_bf16_prefill_matches_within_bf16_rounding():
    case = spans_case(3, SPANS[2], 9, 3, 64, 16, torch.bfloat16)
    got = paged_prefill(*case, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(*case, 0.125), atol=2e-2, rtol=2e-2)


def test_prefill_rejects_spans_outside_q_or_the_block_table():
    q, k, v, table, starts, lens, ctx = spans_case(1, [(0, 20)], 4, 2, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="past its block table"):
        paged_prefill(q, k, v, table[:, :2], starts, lens, ctx, 1.0)
    with pytest.raises(ValueError, match="past q"):
        paged_prefill(q[:10], k, v, table, starts, lens, ctx, 1.0)
    with pytest.raises(ValueError, match="one entry per"):
        paged_prefill(q, k, v, table, starts, lens[:0], ctx, 1.0)
