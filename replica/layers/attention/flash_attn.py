"""flash-attn's varlen kernel over the paged KV cache (CUDA, block size a multiple of 256): one
call attends every request of the step, prefills and decodes alike, reading the block table."""

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

try:  # without it CUDA runs the torch SDPA backend
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None

# flash-attn's paged KV cache requires the page (block) size to be a multiple of this
FLASH_ATTN_BLOCK_MULTIPLE = 256


def paged_kernel_available(device: torch.device | str, block_size: int) -> bool:
    return (
        flash_attn_varlen_func is not None
        and torch.device(device).type == "cuda"
        and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
    )


@dataclass
class FlashAttnMetadata(AttentionMetadata):
    # int32 tensors, as the kernel takes them
    query_start_loc: torch.Tensor  # [B + 1]
    seq_start_loc: torch.Tensor  # [B + 1]
    block_table: torch.Tensor  # [B, max_blocks]
    max_query_len: int
    max_seq_len: int


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    def build(
        self, starts: list[int], query_lens: list[int], block_ids: list[list[int]]
    ) -> tuple[FlashAttnMetadata, torch.Tensor]:
        device = self.device
        layout = step_layout(starts, query_lens, block_ids, self.block_size)
        zero = torch.zeros(1, dtype=torch.long)
        seq_lens_t = torch.tensor(layout.seq_lens, dtype=torch.long)
        meta = FlashAttnMetadata(
            slot_mapping=layout.slot_mapping.to(device),
            query_start_loc=torch.cat([zero, torch.cumsum(layout.q_lens, 0)]).int().to(device),
            seq_start_loc=torch.cat([zero, torch.cumsum(seq_lens_t, 0)]).int().to(device),
            block_table=layout.block_table.int().to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(layout.seq_lens),
        )
        return meta, layout.positions.to(device)


class FlashAttnImpl(AttentionImpl):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: FlashAttnMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        d = self.head_dim
        k_cache, v_cache = kv_cache
        extra = {}  # only where set: flash-attn's defaults are full attention, no cap
        if self.sliding_window is not None:  # keys p - (window - 1) <= j <= p
            extra["window_size"] = (self.sliding_window - 1, 0)
        if self.soft_cap is not None:
            extra["softcap"] = self.soft_cap
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
            **extra,
        )
        return out.reshape(num_tokens, self.num_heads * d)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    builder_cls = FlashAttnMetadataBuilder
    impl_cls = FlashAttnImpl

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return paged_kernel_available(spec.device, spec.block_size)
