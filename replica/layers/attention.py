"""Paged attention over a flat token stream: every layer first writes the step's new K/V into
the block cache by slot, then each request attends to its own blocks with a bottom-right causal
mask. `AttentionMetadata` (built once per step) says where every request's tokens live."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:  # a paged varlen kernel for CUDA; the torch path below is used without it
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None

# flash-attn's paged KV cache requires the page (block) size to be a multiple of this
FLASH_ATTN_BLOCK_MULTIPLE = 256

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, kv_heads, d]


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
    # requests with exactly one query token, batched in one SDPA call (padded + masked)
    decode_token_index: torch.Tensor | None  # [Bd] their token's index in the flat stream
    decode_context_slots: torch.Tensor | None  # [Bd, Lmax] slots of positions 0..L-1 (padded)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] True where a key is real
    prefills: list[PrefillSpan]
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
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata for requests whose tokens start..start+n run this step, laid out back to back,
        and the positions tensor [T]. Index tensors are made with vector ops, not per token."""
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
                decode_token_index=None,
                decode_context_slots=None,
                decode_mask=None,
                prefills=[],
                query_start_loc=torch.cat([zero, torch.cumsum(q_lens, 0)]).int().to(device),
                seq_start_loc=torch.cat([zero, torch.cumsum(seq_lens_t, 0)]).int().to(device),
                block_table=block_table.int().to(device),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
            )
            return meta, positions.to(device)

        decode_reqs = [i for i, n in enumerate(query_lens) if n == 1]
        decode_token_index = decode_slots = decode_mask = None
        if decode_reqs:
            index = torch.tensor(decode_reqs, dtype=torch.long)
            lens = torch.tensor([seq_lens[i] for i in decode_reqs], dtype=torch.long)
            keys = torch.arange(int(lens.max()))
            decode_slots = (
                block_table[index][:, keys // block_size] * block_size + keys % block_size
            )
            real = keys[None, :] < lens[:, None]
            # padding reads position 0 of the same request: written, finite, and masked out
            decode_slots = torch.where(real, decode_slots, decode_slots[:, :1])
            decode_mask = real[:, None, None, :]
            decode_token_index = q_starts[index]

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
            decode_token_index=_to(decode_token_index, device),
            decode_context_slots=_to(decode_slots, device),
            decode_mask=_to(decode_mask, device),
            prefills=prefills,
        )
        return meta, positions.to(device)


def _to(x: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if x is None else x.to(device)


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

        out = torch.empty_like(q)
        if meta.decode_token_index is not None:
            index = meta.decode_token_index
            num_decodes = index.shape[0]
            # GQA folded: the query heads sharing a KV head become that head's query rows,
            # so the KV heads are never copied group times
            qd = q.index_select(0, index).view(num_decodes, self.num_kv_heads, self.group, d)
            kd = flat_k[meta.decode_context_slots].transpose(1, 2)
            vd = flat_v[meta.decode_context_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale
            )
            out.index_copy_(0, index, od.reshape(num_decodes, self.num_heads, d))
        for span in meta.prefills:
            lo, hi = span.query_start, span.query_end
            qp = q[lo:hi].transpose(0, 1).unsqueeze(0)
            if span.context_slots is None:
                kp, vp = k[lo:hi], v[lo:hi]
            else:
                kp, vp = flat_k[span.context_slots], flat_v[span.context_slots]
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
