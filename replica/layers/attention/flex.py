"""torch's flex_attention over the paged KV cache (CUDA): the whole cache is one key sequence
[1, kv_heads, num_blocks * block_size, d] read in place, and a BlockMask built from each step's
block tables tells the fused kernel which cache blocks each query tile visits (the block table
is the mask's sparse index), so no request's keys are gathered or copied.

- Decodes (one query token): one batch lane per request, its query heads grouped under their
  KV head as the query length ([B, kv_heads, group, d], so flex's split-KV decoding kernel runs
  for any group size, 3 included); every block but the last is a full block, the last a partial
  one. The batch is padded to a fixed size (DECODE_BUCKETS) with lanes on a sink block the
  runner keeps past the scheduler's blocks, so the compiled kernels see few shapes and CUDA
  graphs (replica/cuda_graphs.py) can capture them.
- Prefills (more than one query token: whole prompts, chunks after cached context, prefix
  hits): packed back to back in tiles of PREFILL_Q_TILE query rows, each request padded to a
  whole tile so every tile belongs to one request; blocks wholly before a tile's first query
  are full blocks, the diagonal ones partial.

The mask_mod is the whole mask on its own (flex's eager path, which CPU tests run, applies only
the mask_mod; the compiled kernel trusts the block lists and applies the mask_mod to partial
blocks): key slot kv is visible to a query when its block is in the query's request's table at
index j = page_logical[block] and j * block_size + kv % block_size <= the query's position.
page_logical maps each block in this step's tables to its index there; a block in two tables
(a shared prefix) has the same index in both, since prefix caching shares a block only at the
same position.

Needs block_size a multiple of 16 (the kernel's smallest key tile) and head_dim >= 16."""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from replica.layers.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    KVCache,
    step_layout,
)

logger = logging.getLogger(__name__)

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - depends on the torch build
    BlockMask = flex_attention = None

PREFILL_Q_TILE = 128  # query rows per prefill tile (flex's default sparse block)
FLEX_BLOCK_MULTIPLE = 16  # the compiled kernel's smallest key tile
# decode batches are padded up to one of these (or to a multiple of the largest)
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def decode_bucket(n: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> int:
    """The padded decode batch of n lanes: the smallest bucket >= n, else the next multiple
    of the largest."""
    for size in buckets:
        if size >= n:
            return size
    top = buckets[-1]
    return -(-n // top) * top


def flex_available(spec: AttentionSpec) -> bool:
    return (
        flex_attention is not None
        and spec.device.type == "cuda"
        and spec.cuda_attention == "flex"
        and spec.block_size % FLEX_BLOCK_MULTIPLE == 0
        and spec.head_dim >= 16
    )


# the transposed lists serve only the backward pass; a torch without the keyword builds them
_SKIP_Q_BLOCKS = (
    {"compute_q_blocks": False}
    if BlockMask is not None
    and "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)


def _from_kv_blocks(kv_num, kv_idx, full_num, full_idx, q_tile, block_size, mask_mod, lengths):
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(q_tile, block_size),
        mask_mod=mask_mod,
        seq_lengths=lengths,
        **_SKIP_Q_BLOCKS,
    )


def decode_mask_mod(page_logical, table, seq_lens, block_size):
    """Lane b sees key slot kv when kv's block is its table's entry j and j's slot is before
    its length."""
    width = table.shape[1]

    def mask(b, h, q_idx, kv_idx):
        page = kv_idx // block_size
        j = page_logical[page]
        jc = j.clamp(0, width - 1)
        return (
            (j >= 0) & (table[b, jc] == page) & (j * block_size + kv_idx % block_size < seq_lens[b])
        )

    return mask


def prefill_mask_mod(page_logical, table, q_req, q_pos, block_size):
    """Packed query row q (of request q_req[q], at position q_pos[q], -1 on padding rows) sees
    key slot kv when kv's block is its request's entry j and j's slot is at or before q_pos."""
    width = table.shape[1]

    def mask(b, h, q_idx, kv_idx):
        page = kv_idx // block_size
        j = page_logical[page]
        jc = j.clamp(0, width - 1)
        return (
            (j >= 0)
            & (table[q_req[q_idx], jc] == page)
            & (j * block_size + kv_idx % block_size <= q_pos[q_idx])
        )

    return mask


@dataclass
class DecodeBatch:
    """The step's decode lanes (padded) and their mask: query rows rows[i] of the flat stream
    run in lane i; lanes past len(rows) are padding on the sink block."""

    rows: torch.Tensor  # long [n] token index of each real lane
    lanes: int  # padded batch
    mask: Any  # BlockMask [lanes, 1, group, kv_len]


@dataclass
class PrefillBatch:
    rows: torch.Tensor  # long [n] token index in the flat stream
    dest: torch.Tensor  # long [n] its row in the packed, tile-padded queries
    padded_len: int
    mask: Any  # BlockMask [1, 1, padded_len, kv_len]


@dataclass
class FlexMetadata(AttentionMetadata):
    decode: DecodeBatch | None
    prefill: PrefillBatch | None


@dataclass
class DecodeBuffers:
    """Fixed-address decode inputs of `lanes` lanes (CUDA graphs replay over them)."""

    table: torch.Tensor  # int32 [lanes, max_blocks], -1 past each lane's blocks
    seq_lens: torch.Tensor  # int32 [lanes]
    full_num: torch.Tensor  # int32 [lanes, 1, 1]
    last_block: torch.Tensor  # int32 [lanes, 1, 1, 1]
    mask: Any
    full_idx: torch.Tensor | None = None  # int32 [lanes, 1, 1, max_blocks] table clamped >= 0


class FlexMetadataBuilder(AttentionMetadataBuilder):
    """Needs `bind_cache` (the runner's block count and sink block) before the first build."""

    def __init__(self, block_size: int, device: torch.device | str, group: int = 1) -> None:
        super().__init__(block_size, device)
        self.group = group  # query heads per KV head
        self.page_logical: torch.Tensor | None = None
        self.kv_len = 0
        self.sink = -1
        self.max_blocks = 0

    def bind_cache(self, num_blocks: int, sink: int, max_model_len: int) -> None:
        """The cache holds `num_blocks` scheduler blocks plus the sink block `sink` (padding
        lanes write and read it); tables are `max_model_len` tokens long at most."""
        self.kv_len = (max(num_blocks, sink) + 1) * self.block_size
        self.sink = sink
        self.max_blocks = -(-max_model_len // self.block_size)
        total = self.kv_len // self.block_size
        self.page_logical = torch.full((total,), -1, dtype=torch.int32, device=self.device)
        self.page_logical[sink] = 0

    # -- per step ---------------------------------------------------------------------------
    def build(
        self, starts: list[int], query_lens: list[int], block_ids: list[list[int]]
    ) -> tuple[FlexMetadata, torch.Tensor]:
        if self.page_logical is None:
            raise RuntimeError("FlexMetadataBuilder.bind_cache must run before build")
        device = self.device
        layout = step_layout(starts, query_lens, block_ids, self.block_size)
        table = self._tables(block_ids, layout.blocks_per_req)
        self._mark_pages(table)
        decoding = [i for i, n in enumerate(query_lens) if n == 1]
        filling = [i for i, n in enumerate(query_lens) if n > 1]
        decode = prefill = None
        if decoding:
            lanes = decode_bucket(len(decoding))
            rows = layout.q_starts[decoding]
            idx = torch.tensor(decoding, dtype=torch.long)
            seq = torch.tensor(layout.seq_lens, dtype=torch.int32)[idx]
            nblk = torch.tensor(layout.blocks_per_req, dtype=torch.int32)[idx]
            buffers = self._decode_tensors(lanes, table[idx], seq, nblk)
            decode = DecodeBatch(rows.to(device), lanes, buffers.mask)
        if filling:
            prefill = self._prefill(starts, query_lens, layout, table, filling)
        meta = FlexMetadata(
            slot_mapping=layout.slot_mapping.to(device), decode=decode, prefill=prefill
        )
        return meta, layout.positions.to(device)

    def _tables(self, block_ids: list[list[int]], blocks_per_req: list[int]) -> torch.Tensor:
        """int32 [B, max_blocks]: each request's blocks in use, -1 after them (one tensor
        from the concatenated ids, scattered: no per-request tensors)."""
        width = max(self.max_blocks, max(blocks_per_req))
        table = torch.full((len(block_ids), width), -1, dtype=torch.int32)
        counts = torch.tensor(blocks_per_req, dtype=torch.long)
        flat = torch.tensor(
            list(
                itertools.chain.from_iterable(ids[:n] for ids, n in zip(block_ids, blocks_per_req))
            ),
            dtype=torch.int32,
        )
        rows = torch.repeat_interleave(torch.arange(len(block_ids)), counts)
        cols = torch.arange(flat.numel()) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        table[rows, cols] = flat
        return table

    def _mark_pages(self, table: torch.Tensor) -> None:
        """page_logical[block] = its index in this step's tables."""
        real = table >= 0
        pages = table[real].long()
        logical = torch.nonzero(real)[:, 1].to(torch.int32)
        self.page_logical.index_copy_(0, pages.to(self.device), logical.to(self.device))

    def _decode_tensors(
        self, lanes: int, table: torch.Tensor, seq: torch.Tensor, nblk: torch.Tensor
    ) -> DecodeBuffers:
        n = table.shape[0]
        full = torch.full((lanes, table.shape[1]), -1, dtype=torch.int32)
        full[:n] = table
        full[n:, 0] = self.sink
        seq_all = torch.ones(lanes, dtype=torch.int32)
        seq_all[:n] = seq
        nblk_all = torch.ones(lanes, dtype=torch.int32)
        nblk_all[:n] = nblk
        last = full.gather(1, (nblk_all.long() - 1)[:, None])
        device = self.device
        buffers = DecodeBuffers(
            table=full.to(device),
            seq_lens=seq_all.to(device),
            full_num=(nblk_all - 1).view(lanes, 1, 1).to(device),
            last_block=last.view(lanes, 1, 1, 1).to(device),
            mask=None,
        )
        buffers.mask = self._decode_mask(buffers)
        return buffers

    def _decode_mask(self, buffers: DecodeBuffers) -> Any:
        lanes = buffers.table.shape[0]
        ones = torch.ones((lanes, 1, 1), dtype=torch.int32, device=buffers.table.device)
        mask_mod = decode_mask_mod(
            self.page_logical, buffers.table, buffers.seq_lens, self.block_size
        )
        return _from_kv_blocks(
            ones,
            buffers.last_block,
            buffers.full_num,
            buffers.table.clamp(min=0).view(lanes, 1, 1, -1),
            PREFILL_Q_TILE,
            self.block_size,
            mask_mod,
            (self.group, self.kv_len),
        )

    # -- decode under CUDA graphs -------------------------------------------------------------
    def static_decode(self, lanes: int) -> DecodeBuffers:
        """Decode inputs of `lanes` lanes at fixed addresses, refilled by `fill_decode`."""
        width = self.max_blocks
        device = self.device
        buffers = DecodeBuffers(
            table=torch.full((lanes, width), -1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(lanes, dtype=torch.int32, device=device),
            full_num=torch.zeros((lanes, 1, 1), dtype=torch.int32, device=device),
            last_block=torch.full((lanes, 1, 1, 1), self.sink, dtype=torch.int32, device=device),
            mask=None,
        )
        buffers.table[:, 0] = self.sink
        # the kernel reads the full blocks' list from a non-negative copy of the table, which
        # fill_decode refreshes with it
        buffers.full_idx = torch.zeros((lanes, 1, 1, width), dtype=torch.int32, device=device)
        ones = torch.ones((lanes, 1, 1), dtype=torch.int32, device=device)
        mask_mod = decode_mask_mod(
            self.page_logical, buffers.table, buffers.seq_lens, self.block_size
        )
        buffers.mask = _from_kv_blocks(
            ones,
            buffers.last_block,
            buffers.full_num,
            buffers.full_idx,
            PREFILL_Q_TILE,
            self.block_size,
            mask_mod,
            (self.group, self.kv_len),
        )
        return buffers

    def fill_decode(
        self, buffers: DecodeBuffers, starts: list[int], block_ids: list[list[int]]
    ) -> None:
        """Write a decode step of len(starts) requests (one query token each, at position
        starts[i]) into `buffers`; the lanes after them become sink lanes."""
        lanes = buffers.table.shape[0]
        n = len(starts)
        seq = [s + 1 for s in starts]
        nblk = [-(-s // self.block_size) for s in seq]
        table = self._tables(block_ids, nblk)[:, : self.max_blocks]
        self._mark_pages(table)
        host = torch.full((lanes, self.max_blocks), -1, dtype=torch.int32)
        host[:n] = table
        host[n:, 0] = self.sink
        seq_all = torch.ones(lanes, dtype=torch.int32)
        seq_all[:n] = torch.tensor(seq, dtype=torch.int32)
        nblk_all = torch.ones(lanes, dtype=torch.int32)
        nblk_all[:n] = torch.tensor(nblk, dtype=torch.int32)
        last = host.gather(1, (nblk_all.long() - 1)[:, None])
        buffers.table.copy_(host, non_blocking=True)
        buffers.full_idx.copy_(host.clamp(min=0).view(lanes, 1, 1, -1), non_blocking=True)
        buffers.seq_lens.copy_(seq_all, non_blocking=True)
        buffers.full_num.copy_((nblk_all - 1).view(lanes, 1, 1), non_blocking=True)
        buffers.last_block.copy_(last.view(lanes, 1, 1, 1), non_blocking=True)

    # -- prefill ------------------------------------------------------------------------------
    def _prefill(
        self,
        starts: list[int],
        query_lens: list[int],
        layout,
        table: torch.Tensor,
        filling: list[int],
    ) -> PrefillBatch:
        bs, tile = self.block_size, PREFILL_Q_TILE
        idx = torch.tensor(filling, dtype=torch.long)
        n = layout.q_lens[idx]
        start = torch.tensor(starts, dtype=torch.long)[idx]
        tiles = -(-n // tile)
        num_tiles = int(tiles.sum())
        # at least 2 tiles and 2 entries per list: sizes 0 and 1 would each be a shape of
        # their own to the compiler (its 0/1 specialization)
        padded_tiles = max(num_tiles, 2)
        req_of_tile = torch.repeat_interleave(torch.arange(len(filling)), tiles)
        tile_in_req = torch.arange(num_tiles) - torch.repeat_interleave(
            torch.cumsum(tiles, 0) - tiles, tiles
        )
        first = start[req_of_tile] + tile_in_req * tile  # position of each tile's first query
        last = torch.minimum(first + tile, (start + n)[req_of_tile]) - 1
        n_full = (first + 1) // bs  # blocks wholly at or before the first query
        n_part = last // bs - n_full + 1
        rows_table = table[idx].long()  # [P, width]
        width_full = max(int(n_full.max()), 2)
        width_part = max(int(n_part.max()), 2)
        k = torch.arange(width_full)
        full_idx = rows_table[req_of_tile[:, None], k.clamp(max=rows_table.shape[1] - 1)]
        full_idx = torch.where(k < n_full[:, None], full_idx, 0)
        k = torch.arange(width_part)
        pos = (n_full[:, None] + k).clamp(max=rows_table.shape[1] - 1)
        part_idx = rows_table[req_of_tile[:, None], pos]
        part_idx = torch.where(k < n_part[:, None], part_idx, 0)

        def pad(x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((padded_tiles,) + x.shape[1:], dtype=torch.int32)
            out[:num_tiles] = x
            return out

        # packed rows: request r's tokens from row tile * (tiles before r)
        tile_base = (torch.cumsum(tiles, 0) - tiles) * tile
        dest = torch.cat([tile_base[i] + torch.arange(int(n[i])) for i in range(len(filling))])
        rows = torch.cat([layout.q_starts[r] + torch.arange(int(query_lens[r])) for r in filling])
        padded_len = padded_tiles * tile
        q_pos = torch.full((padded_len,), -1, dtype=torch.int32)
        q_pos[dest] = layout.positions[rows].to(torch.int32)
        q_req = torch.zeros(padded_len, dtype=torch.int32)
        q_req[dest] = torch.repeat_interleave(torch.arange(len(filling)), n).to(torch.int32)
        device = self.device
        mask_mod = prefill_mask_mod(
            self.page_logical,
            rows_table.to(torch.int32).to(device),
            q_req.to(device),
            q_pos.to(device),
            bs,
        )
        mask = _from_kv_blocks(
            pad(n_part).view(1, 1, padded_tiles).to(device),
            pad(part_idx).view(1, 1, padded_tiles, width_part).to(device),
            pad(n_full).view(1, 1, padded_tiles).to(device),
            pad(full_idx).view(1, 1, padded_tiles, width_full).to(device),
            tile,
            bs,
            mask_mod,
            (padded_len, self.kv_len),
        )
        return PrefillBatch(rows.to(device), dest.to(device), padded_len, mask)


def _flex_decode(q, k, v, block_mask, scale):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


def _flex_prefill(q, k, v, block_mask, scale):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


@functools.cache
def compiled_flex(kind: str):
    """The compiled flex call for decodes (static shapes: few, by DECODE_BUCKETS, and flex's
    decoding kernel needs a static batch) or prefills (dynamic shapes); eager on CPU."""
    fn = _flex_decode if kind == "decode" else _flex_prefill
    if not torch.cuda.is_available():
        return fn
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
    return torch.compile(fn, dynamic=(kind != "decode"), fullgraph=True)


class FlexImpl(AttentionImpl):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: FlexMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache
        # the cache as one key sequence, in place: [1, kv_heads, blocks * block_size, d]
        keys = k_cache.view(1, -1, hkv, d).transpose(1, 2)
        values = v_cache.view(1, -1, hkv, d).transpose(1, 2)
        eager = q.device.type != "cuda"
        out = q.new_zeros(num_tokens, hq, d)
        if meta.decode is not None:
            dec = meta.decode
            n = dec.rows.shape[0]
            qd = q.new_zeros(dec.lanes, hq, d)
            qd[:n] = q.index_select(0, dec.rows)
            fn = _flex_decode if eager else compiled_flex("decode")
            od = fn(qd.view(dec.lanes, hkv, self.group, d), keys, values, dec.mask, self.scale)
            out.index_copy_(0, dec.rows, od.reshape(dec.lanes, hq, d)[:n])
        if meta.prefill is not None:
            pre = meta.prefill
            qp = q.new_zeros(pre.padded_len, hq, d)
            qp.index_copy_(0, pre.dest, q.index_select(0, pre.rows))
            fn = _flex_prefill if eager else compiled_flex("prefill")
            op = fn(qp.transpose(0, 1).unsqueeze(0), keys, values, pre.mask, self.scale)
            out.index_copy_(0, pre.rows, op[0].transpose(0, 1).index_select(0, pre.dest))
        return out.view(num_tokens, hq * d)


class FlexAttentionBackend(AttentionBackend):
    name = "flex"
    builder_cls = FlexMetadataBuilder
    impl_cls = FlexImpl
    needs_sink_block = True  # padding lanes write K/V to a block the scheduler never hands out

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        # its block masks are built once per step for every layer: no per-layer sliding
        # window or soft cap (the selector says so and falls back)
        return not spec.sliding_windows and not spec.soft_cap and flex_available(spec)

    @classmethod
    def make_builder(cls, spec: AttentionSpec) -> FlexMetadataBuilder:
        # the model's query heads per KV head come with the impl; the builder needs the
        # group as the decode query length
        return FlexMetadataBuilder(spec.block_size, spec.device, spec.group)
