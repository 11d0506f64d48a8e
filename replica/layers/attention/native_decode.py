"""CPU (fp32, bf16) with the native library: decodes run the C paged decode kernel, which reads
each request's K/V where they lie in the block cache (nothing gathered); prefills run torch SDPA
as in torch_sdpa.py."""

from __future__ import annotations

from dataclasses import dataclass

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
from replica.layers.attention.torch_sdpa import PrefillSpan, attend_prefills, prefill_spans
from replica.layers.cpu_kernels import KERNEL_DTYPES, native_library, paged_decode_unchecked


@dataclass
class DecodeBatch:
    """Every request with exactly one query token, for the native paged decode kernel."""

    token_index: torch.Tensor  # [n] their token's index in the flat stream
    block_table: torch.Tensor  # int32 [n, max_blocks]
    seq_lens: torch.Tensor  # int32 [n] keys each attends to (its position + 1)
    all_tokens: bool  # the step is decodes only, in stream order: no gather or scatter of q


@dataclass
class NativeDecodeMetadata(AttentionMetadata):
    decode_batch: DecodeBatch | None  # None: no decode this step
    prefills: list[PrefillSpan]


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


class NativeDecodeMetadataBuilder(AttentionMetadataBuilder):
    def build(
        self, starts: list[int], query_lens: list[int], block_ids: list[list[int]]
    ) -> tuple[NativeDecodeMetadata, torch.Tensor]:
        block_size, device = self.block_size, self.device
        layout = step_layout(starts, query_lens, block_ids, block_size)
        meta = NativeDecodeMetadata(
            slot_mapping=layout.slot_mapping.to(device),
            decode_batch=_decode_batch(
                query_lens, layout.seq_lens, layout.block_table, block_size, layout.q_starts, device
            ),
            prefills=prefill_spans(starts, query_lens, layout, block_size, device),
        )
        return meta, layout.positions.to(device)


class NativeDecodeImpl(AttentionImpl):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: NativeDecodeMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        d = self.head_dim
        k_cache, v_cache = kv_cache
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
        if meta.prefills:
            attend_prefills(self, out, q, k, v, kv_cache, meta.prefills)
        return out.view(num_tokens, self.num_heads * d)


class NativeDecodeBackend(AttentionBackend):
    name = "native_decode"
    builder_cls = NativeDecodeMetadataBuilder
    impl_cls = NativeDecodeImpl

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return (
            spec.device.type == "cpu"
            and spec.cpu_decode_attention == "native"
            and spec.dtype in KERNEL_DTYPES
            and native_library() is not None
        )
