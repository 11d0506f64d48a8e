"""Torch SDPA attention, the backend that runs on every device: decodes gathered block by block
into groups of similar context length (padded, masked), each prefill in its own causal SDPA call
(the prefill half is shared with the native decode backend). A layer with a sliding window
adds the window to the mask (and a prefill gathers only the keys its window reaches); a layer
with a soft cap runs the same attention as explicit ops, capping the scores before the mask."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    seq_lens: torch.Tensor | None = None  # [g] keys each attends to (for window masks)
    # window -> mask [g, 1, 1, keys]: made by the first layer of that window in the step
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int, block_size: int) -> torch.Tensor:
        """Keys p - window < j <= p of each member (p: its query's position)."""
        mask = self.window_masks.get(window)
        if mask is None:
            lens = self.seq_lens[:, None]
            keys = torch.arange(self.num_blocks * block_size, device=lens.device)[None, :]
            mask = ((keys < lens) & (keys >= lens - window))[:, None, None, :]
            self.window_masks[window] = mask
        return mask


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
    start: int = 0  # the position of its first query token
    # window -> (the slots of the keys the window reaches, or None: the span's own new K/V;
    # its mask [n, keys]): made by the first layer of that window in the step
    window_views: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)

    def window_view(self, window: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The keys a window lets this span's queries see: from the earliest query's window
        on, masked to p - window < j <= p per query (position p)."""
        view = self.window_views.get(window)
        if view is None:
            n, start = self.query_end - self.query_start, self.start
            first = max(0, start - window + 1)
            device = self.mask.device if self.mask is not None else None
            positions = torch.arange(start, start + n, device=device)[:, None]
            keys = torch.arange(first, start + n, device=device)[None, :]
            mask = (keys <= positions) & (keys > positions - window)
            slots = None if self.context_slots is None else self.context_slots[first:]
            view = self.window_views[window] = (slots, mask)
        return view


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
        prefills.append(PrefillSpan(q0, q0 + n, slots.to(device), mask.to(device), start))
    return prefills


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
    causal: bool = False,
) -> torch.Tensor:
    """q [B, H, n, d] against k, v [B, H_kv, m, d] (H a multiple of H_kv; mask True where a key
    is seen, broadcast to [B, H, n, m]; causal: bottom-right). With a soft cap it is explicit
    ops in transformers' order: scores * scale, capped, masked, softmax, times v."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if causal:
        n, m = q.shape[-2], k.shape[-2]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


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
    window = impl.sliding_window
    for span in prefills:
        lo, hi = span.query_start, span.query_end
        qp = q[lo:hi].transpose(0, 1).unsqueeze(0)
        slots, mask = span.context_slots, span.mask
        if window is not None and window < span.start + hi - lo:  # some key is outside it
            slots, mask = span.window_view(window)
        if slots is None:
            kp, vp = k[lo:hi], v[lo:hi]
        else:
            kp = flat_k.index_select(0, slots)
            vp = flat_v.index_select(0, slots)
        op = attention(
            qp,
            kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0),
            mask,
            impl.scale,
            impl.soft_cap,
            causal=mask is None,
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
                seq_lens=lens.to(device),
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
                mask = group.mask
                if self.sliding_window is not None and self.sliding_window < num_keys:
                    mask = group.window_mask(self.sliding_window, block_size)
                od = attention(
                    qd, kd.transpose(1, 2), vd.transpose(1, 2), mask, self.scale, self.soft_cap
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
