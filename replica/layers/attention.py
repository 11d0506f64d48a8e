"""Paged attention over a flat token stream: every layer first writes the step's new K/V into
the block cache by slot, then each request attends to its own blocks with a bottom-right causal
mask. `AttentionMetadata` (built once per step) says where every request's tokens live."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.cpu_kernels import paged_decode_unchecked

try:  # a paged varlen kernel for CUDA; the torch path below is used without it
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None

# flash-attn's paged KV cache requires the page (block) size to be a multiple of this
FLASH_ATTN_BLOCK_MULTIPLE = 256

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, kv_heads, d]

# CPU: decodes are attended in groups of similar context length, each padded to its longest
# member and small enough that its gathered K (and V) stay in cache between the gather and the
# attention that reads them. On a 2-core AVX-512 machine (1 MiB L2 per core) groups of ~1.5 MiB
# of K ran several times faster than one padded batch, whose copies go through memory twice.
DECODE_GROUP_BYTES = 3 << 19
DEFAULT_DECODE_GROUP_KEYS = 2048  # DECODE_GROUP_BYTES of fp32 keys with 3 KV heads of 64


@dataclass
class DecodeGroup:
    """Requests with exactly one query token, attended in one SDPA call over their gathered
    blocks: queries [g, kv_heads, group, d] against keys [g, kv_heads, num_blocks * block_size, d]."""

    token_index: torch.Tensor  # [g] their token's index in the flat stream
    block_ids: torch.Tensor  # [g * num_blocks] each request's blocks, padded with its first
    num_blocks: int
    mask: torch.Tensor | None  # [g, 1, 1, num_blocks * block_size] True where a key is real


@dataclass
class DecodeBatch:
    """Every request with exactly one query token, for the native paged decode kernel, which
    reads each request's K/V where they lie in the block cache (nothing gathered)."""

    token_index: torch.Tensor  # [n] their token's index in the flat stream
    block_table: torch.Tensor  # int32 [n, max_blocks]
    seq_lens: torch.Tensor  # int32 [n] keys each attends to (its position + 1)
    all_tokens: bool  # the step is decodes only, in stream order: no gather or scatter of q


@dataclass
class PrefillSpan:
    """A request with more than one query token, attended in its own SDPA call."""

    query_start: int  # its tokens are q[query_start:query_end] of the flat stream
    query_end: int
    # None when the chunk starts at position 0: its own new K/V are the whole context and a
    # plain causal mask is right. Otherwise the cache slots of positions 0..start+n and the
    # bottom-right causal mask [n, start+n].
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each request attends to; shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    decodes: list[DecodeGroup]  # requests with exactly one query token, padded + masked
    prefills: list[PrefillSpan]
    decode_batch: DecodeBatch | None = None  # instead of `decodes` when the kernel runs them
    # for a varlen/paged kernel (CUDA): int32 tensors
    query_start_loc: torch.Tensor | None = None  # [B + 1]
    seq_start_loc: torch.Tensor | None = None  # [B + 1]
    block_table: torch.Tensor | None = None  # [B, max_blocks]
    max_query_len: int = 0
    max_seq_len: int = 0

    @property
    def use_paged_kernel(self) -> bool:
        return self.block_table is not None

    @classmethod
    def build(
        cls,
        starts: list[int],
        query_lens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        paged_kernel: bool = False,
        decode_group_keys: int | None = DEFAULT_DECODE_GROUP_KEYS,
        native_decode: bool = False,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata for requests whose tokens start..start+n run this step, laid out back to back,
        and the positions tensor [T]. Index tensors are made with vector ops, not per token;
        decodes are grouped so a group's padded keys stay within `decode_group_keys` (None: all
        decodes in one group). `native_decode`: decodes go to the native paged kernel as one
        DecodeBatch instead of gathered groups."""
        num_reqs = len(starts)
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        blocks_per_req = [-(-n // block_size) for n in seq_lens]
        max_blocks = max(blocks_per_req)
        table = [ids[:n] + [0] * (max_blocks - n) for ids, n in zip(block_ids, blocks_per_req)]
        block_table = torch.tensor(table, dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        q_starts = torch.cumsum(q_lens, 0) - q_lens
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
        num_tokens = int(q_lens.sum())
        positions = (
            torch.arange(num_tokens)
            - q_starts[req_of_token]
            + torch.tensor(starts, dtype=torch.long)[req_of_token]
        )
        slot_mapping = (
            block_table[req_of_token, positions // block_size] * block_size + positions % block_size
        )

        if paged_kernel:  # the kernel reads the block table itself
            zero = torch.zeros(1, dtype=torch.long)
            seq_lens_t = torch.tensor(seq_lens, dtype=torch.long)
            meta = cls(
                slot_mapping=slot_mapping.to(device),
                decodes=[],
                prefills=[],
                query_start_loc=torch.cat([zero, torch.cumsum(q_lens, 0)]).int().to(device),
                seq_start_loc=torch.cat([zero, torch.cumsum(seq_lens_t, 0)]).int().to(device),
                block_table=block_table.int().to(device),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
            )
            return meta, positions.to(device)

        decodes: list[DecodeGroup] = []
        decode_batch = None
        if native_decode:
            decode_batch = _decode_batch(
                query_lens, seq_lens, block_table, block_size, q_starts, device
            )
        else:
            decodes = _decode_groups(
                query_lens,
                blocks_per_req,
                seq_lens,
                block_table,
                q_starts,
                block_size,
                decode_group_keys,
                device,
            )

        prefills = []
        for i, n in enumerate(query_lens):
            if n == 1:
                continue
            q0 = int(q_starts[i])
            start = starts[i]
            if start == 0:
                prefills.append(PrefillSpan(q0, q0 + n, None, None))
                continue
            keys = torch.arange(start + n)
            slots = block_table[i, keys // block_size] * block_size + keys % block_size
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
            prefills.append(PrefillSpan(q0, q0 + n, slots.to(device), mask.to(device)))

        meta = cls(
            slot_mapping=slot_mapping.to(device),
            decodes=decodes,
            prefills=prefills,
            decode_batch=decode_batch,
        )
        return meta, positions.to(device)


def _decode_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
    q_starts: torch.Tensor,
    device: torch.device | str,
) -> DecodeBatch | None:
    """Checked here, once per step, what the kernel relies on (int32 contiguous tables, every
    length within its table row); the layers then call it unchecked."""
    decode_reqs = [i for i, n in enumerate(query_lens) if n == 1]
    if not decode_reqs:
        return None
    lens = [seq_lens[i] for i in decode_reqs]
    if max(lens) > block_table.shape[1] * block_size:
        raise ValueError(
            f"a decode of {max(lens)} keys is longer than its block table "
            f"({block_table.shape[1]} blocks of {block_size})"
        )
    index = torch.tensor(decode_reqs, dtype=torch.long)
    return DecodeBatch(
        token_index=q_starts[index].to(device),
        block_table=block_table[index].to(torch.int32).contiguous().to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32).to(device),
        all_tokens=len(decode_reqs) == len(query_lens),
    )


def _decode_groups(
    query_lens: list[int],
    blocks_per_req: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    q_starts: torch.Tensor,
    block_size: int,
    group_keys: int | None,
    device: torch.device | str,
) -> list[DecodeGroup]:
    """Decodes sorted by context length, longest first, cut into groups whose padded keys
    (members x the first member's blocks) stay within `group_keys`."""
    decode_reqs = [i for i, n in enumerate(query_lens) if n == 1]
    if not decode_reqs:
        return []
    decode_reqs.sort(key=lambda i: -seq_lens[i])
    limit = (
        group_keys
        if group_keys is not None
        else len(decode_reqs) * block_table.shape[1] * block_size
    )
    groups = []
    first = 0
    while first < len(decode_reqs):
        num_blocks = blocks_per_req[decode_reqs[first]]
        size = max(1, limit // (num_blocks * block_size))
        members = decode_reqs[first : first + size]
        first += len(members)
        index = torch.tensor(members, dtype=torch.long)
        tables = block_table[index, :num_blocks]
        lens = torch.tensor([seq_lens[i] for i in members], dtype=torch.long)
        keys = torch.arange(num_blocks * block_size)
        real = keys[None, :] < lens[:, None]
        mask = None if bool(real.all()) else real[:, None, None, :].to(device)
        # padding blocks point at the request's first block: written, finite, masked out
        real_blocks = (
            torch.arange(num_blocks)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
        )
        tables = torch.where(real_blocks, tables, tables[:, :1])
        groups.append(
            DecodeGroup(
                token_index=q_starts[index].to(device),
                block_ids=tables.reshape(-1).to(device),
                num_blocks=num_blocks,
                mask=mask,
            )
        )
    return groups


def paged_kernel_available(device: torch.device | str, block_size: int) -> bool:
    return (
        flash_attn_varlen_func is not None
        and torch.device(device).type == "cuda"
        and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
    )


class Attention(nn.Module):
    """Attention of this rank's heads; q/k/v come in flat [T, heads * head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.group = num_heads // num_kv_heads

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        d = self.head_dim
        q = q.view(num_tokens, self.num_heads, d)
        k = k.view(num_tokens, self.num_kv_heads, d)
        v = v.view(num_tokens, self.num_kv_heads, d)
        k_cache, v_cache = kv_cache
        flat_k = k_cache.view(-1, self.num_kv_heads, d)
        flat_v = v_cache.view(-1, self.num_kv_heads, d)
        # every new K/V first, so a request may read blocks another request writes this step
        # (a prefix-cache hit on a block being filled in the same step)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        if meta.use_paged_kernel:
            out = flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=meta.query_start_loc,
                cu_seqlens_k=meta.seq_start_loc,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_seq_len,
                softmax_scale=self.scale,
                causal=True,  # flash-attn aligns the causal mask bottom-right
                block_table=meta.block_table,
            )
            return out.reshape(num_tokens, self.num_heads * d)

        batch = meta.decode_batch
        if batch is not None and batch.all_tokens:  # a pure decode step: q is in stream order
            out = paged_decode_unchecked(
                q, k_cache, v_cache, batch.block_table, batch.seq_lens, self.scale
            )
            return out.view(num_tokens, self.num_heads * d)
        out = torch.empty_like(q)
        if batch is not None:
            qd = q.index_select(0, batch.token_index)
            od = paged_decode_unchecked(
                qd, k_cache, v_cache, batch.block_table, batch.seq_lens, self.scale
            )
            out.index_copy_(0, batch.token_index, od)
        if meta.decodes:
            block_size = k_cache.shape[1]
            for group in meta.decodes:
                g = group.token_index.shape[0]
                num_keys = group.num_blocks * block_size
                # GQA folded: the query heads sharing a KV head become that head's query rows,
                # so the KV heads are never copied group times
                qd = q.index_select(0, group.token_index).view(g, self.num_kv_heads, self.group, d)
                # whole blocks, gathered contiguously: [g, keys, kv_heads, d] -> heads first
                kd = k_cache.index_select(0, group.block_ids).view(g, num_keys, -1, d)
                vd = v_cache.index_select(0, group.block_ids).view(g, num_keys, -1, d)
                od = F.scaled_dot_product_attention(
                    qd,
                    kd.transpose(1, 2),
                    vd.transpose(1, 2),
                    attn_mask=group.mask,
                    scale=self.scale,
                )
                out.index_copy_(0, group.token_index, od.reshape(g, self.num_heads, d))
        for span in meta.prefills:
            lo, hi = span.query_start, span.query_end
            qp = q[lo:hi].transpose(0, 1).unsqueeze(0)
            if span.context_slots is None:
                kp, vp = k[lo:hi], v[lo:hi]
            else:
                kp = flat_k.index_select(0, span.context_slots)
                vp = flat_v.index_select(0, span.context_slots)
            op = F.scaled_dot_product_attention(
                qp,
                kp.transpose(0, 1).unsqueeze(0),
                vp.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
                enable_gqa=self.group > 1,
            )
            out[lo:hi] = op[0].transpose(0, 1)
        return out.view(num_tokens, self.num_heads * d)
