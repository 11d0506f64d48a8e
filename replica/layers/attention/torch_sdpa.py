"""Torch SDPA attention, the backend that runs on every device: decodes gathered block by block
into groups of similar context length (padded, masked), each prefill in its own causal SDPA call
(the prefill half is shared with the native decode backend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replica.layers.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    KVCache,
    StepLayout,
    step_layout,
)

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
class TorchSDPAMetadata(AttentionMetadata):
    decodes: list[DecodeGroup]  # requests with exactly one query token, padded + masked
    prefills: list[PrefillSpan]

    @classmethod
    def build(
        cls,
        starts: list[int],
        query_lens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> tuple[TorchSDPAMetadata, torch.Tensor]:
        """Torch SDPA metadata and the positions [T], for a model run without a runner (its
        layers keep the torch SDPA impl they are built with); a runner builds the metadata of the
        backend it chose with that backend's builder."""
        builder = TorchSDPAMetadataBuilder(block_size, device, DEFAULT_DECODE_GROUP_KEYS)
        return builder.build(starts, query_lens, block_ids)


def decode_group_keys(spec: AttentionSpec) -> int | None:
    """Keys per decode attention group: on CPU as many as keep one group's gathered K within
    DECODE_GROUP_BYTES; on CUDA one group (many small kernels would cost more)."""
    if spec.device.type == "cuda":
        return None
    element = torch.empty((), dtype=spec.dtype).element_size()
    return max(spec.block_size, DECODE_GROUP_BYTES // (spec.num_kv_heads * spec.head_dim * element))


def prefill_spans(
    starts: list[int],
    query_lens: list[int],
    layout: StepLayout,
    block_size: int,
    device: torch.device | str,
    only: set[int] | None = None,
) -> list[PrefillSpan]:
    """One span per request with more than one query token (of the requests in `only`)."""
    prefills = []
    for i, n in enumerate(query_lens):
        if n == 1 or (only is not None and i not in only):
            continue
        q0 = int(layout.q_starts[i])
        start = starts[i]
        if start == 0:
            prefills.append(PrefillSpan(q0, q0 + n, None, None))
            continue
        keys = torch.arange(start + n)
        slots = layout.block_table[i, keys // block_size] * block_size + keys % block_size
        mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        prefills.append(PrefillSpan(q0, q0 + n, slots.to(device), mask.to(device)))
    return prefills


def attend_prefills(
    impl: AttentionImpl,
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    prefills: list[PrefillSpan],
) -> None:
    """Each span's SDPA into out[span] (q/k/v [T, heads, d], the step's K/V already cached)."""
    d = impl.head_dim
    k_cache, v_cache = kv_cache
    flat_k = k_cache.view(-1, impl.num_kv_heads, d)
    flat_v = v_cache.view(-1, impl.num_kv_heads, d)
    for span in prefills:
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
            scale=impl.scale,
            enable_gqa=impl.group > 1,
        )
        out[lo:hi] = op[0].transpose(0, 1)


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


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, block_size: int, device: torch.device | str, group_keys: int | None) -> None:
        """Decodes are grouped so a group's padded keys stay within `group_keys` (None: all
        decodes in one group)."""
        super().__init__(block_size, device)
        self.group_keys = group_keys

    def build(
        self, starts: list[int], query_lens: list[int], block_ids: list[list[int]]
    ) -> tuple[TorchSDPAMetadata, torch.Tensor]:
        block_size, device = self.block_size, self.device
        layout = step_layout(starts, query_lens, block_ids, block_size)
        decodes = _decode_groups(
            query_lens,
            layout.blocks_per_req,
            layout.seq_lens,
            layout.block_table,
            layout.q_starts,
            block_size,
            self.group_keys,
            device,
        )
        meta = TorchSDPAMetadata(
            slot_mapping=layout.slot_mapping.to(device),
            decodes=decodes,
            prefills=prefill_spans(starts, query_lens, layout, block_size, device),
        )
        return meta, layout.positions.to(device)


class TorchSDPAImpl(AttentionImpl):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: TorchSDPAMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        d = self.head_dim
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
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
        if meta.prefills:
            attend_prefills(self, out, q, k, v, kv_cache, meta.prefills)
        return out.view(num_tokens, self.num_heads * d)


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    builder_cls = TorchSDPAMetadataBuilder
    impl_cls = TorchSDPAImpl

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return True  # torch ops only: the fallback on every device

    @classmethod
    def make_builder(cls, spec: AttentionSpec) -> TorchSDPAMetadataBuilder:
        return TorchSDPAMetadataBuilder(spec.block_size, spec.device, decode_group_keys(spec))
