"""CPU (fp32, bf16) with the native library: decodes run the C paged decode kernel, which reads
each request's K/V where they lie in the block cache (nothing gathered); prefills (requests with
more than one query token: whole prompts, chunks after cached context) run the tiled C prefill
kernel the same way, or torch SDPA as in torch_sdpa.py with cpu_prefill_attention='torch'."""

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
    StepLayout,
    step_layout,
)
from replica.layers.attention.torch_sdpa import PrefillSpan, attend_prefills, prefill_spans
from replica.layers.cpu_kernels import (
    KERNEL_DTYPES,
    native_library,
    paged_decode_unchecked,
    paged_prefill_unchecked,
)


@dataclass
class DecodeBatch:
    """Every request with exactly one query token, for the native paged decode kernel."""

    token_index: torch.Tensor  # [n] their token's index in the flat stream
    block_table: torch.Tensor  # int32 [n, max_blocks]
    seq_lens: torch.Tensor  # int32 [n] keys each attends to (its position + 1)
    all_tokens: bool  # the step is decodes only, in stream order: no gather or scatter of q


@dataclass
class PrefillBatch:
    """Every request with more than one query token, for the native prefill kernel."""

    block_table: torch.Tensor  # int32 [n, max_blocks]
    q_starts: torch.Tensor  # int32 [n] its first token's index in the flat stream
    q_lens: torch.Tensor  # int32 [n]
    ctx_starts: torch.Tensor  # int32 [n] the position of its first query token


@dataclass
class NativeDecodeMetadata(AttentionMetadata):
    decode_batch: DecodeBatch | None  # None: no decode this step
    prefills: list[PrefillSpan]  # for torch SDPA (cpu_prefill_attention='torch')
    prefill_batch: PrefillBatch | None = None  # for the native kernel; None: none, or torch


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


# At AVX2, a prefill whose queries attend more keys than this runs torch SDPA instead: past
# ~1k keys torch's blocked flash-attention kernel can beat the AVX2 build, while the AVX-512
# build beats it at every length measured, up to 8192 keys, so it has no limit
# (docs/perf-engine.md, "Prefill attention").
NATIVE_PREFILL_MAX_KEYS = 1024
NO_KEY_LIMIT_LEVELS = ("avx512", "avx512_vnni", "avx512_bf16")


def native_prefill_max_keys(level: str) -> int | None:
    """The most keys a prefill's queries may attend to take the native kernel at `level`
    (None: no limit)."""
    return None if level in NO_KEY_LIMIT_LEVELS else NATIVE_PREFILL_MAX_KEYS


def _prefill_batch(spans: list[int], layout: StepLayout, block_size: int) -> PrefillBatch | None:
    """The requests `spans` (indices in the step) for the native prefill kernel; checked here,
    once per step, what the kernel relies on (as _decode_batch)."""
    if not spans:
        return None
    longest = max(layout.seq_lens[i] for i in spans)
    table = layout.block_table
    if longest > table.shape[1] * block_size:
        raise ValueError(
            f"a prefill of {longest} keys is longer than its block table "
            f"({table.shape[1]} blocks of {block_size})"
        )
    index = torch.tensor(spans, dtype=torch.long)
    starts = [layout.seq_lens[i] - int(layout.q_lens[i]) for i in spans]
    return PrefillBatch(
        block_table=table[index].to(torch.int32).contiguous(),
        q_starts=layout.q_starts[index].to(torch.int32).contiguous(),
        q_lens=layout.q_lens[index].to(torch.int32).contiguous(),
        ctx_starts=torch.tensor(starts, dtype=torch.int32),
    )


class NativeDecodeMetadataBuilder(AttentionMetadataBuilder):
    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        native_prefill: bool,
        max_keys: int | None = NATIVE_PREFILL_MAX_KEYS,
    ) -> None:
        super().__init__(block_size, device)
        self.native_prefill = native_prefill
        self.max_keys = max_keys  # longer prefills run torch SDPA (None: no limit)

    def build(
        self, starts: list[int], query_lens: list[int], block_ids: list[list[int]]
    ) -> tuple[NativeDecodeMetadata, torch.Tensor]:
        block_size, device = self.block_size, self.device
        layout = step_layout(starts, query_lens, block_ids, block_size)
        batch, torch_only = None, None  # None: every prefill on torch SDPA
        if self.native_prefill:
            limit = self.max_keys
            native = [
                i
                for i, n in enumerate(query_lens)
                if n > 1 and (limit is None or layout.seq_lens[i] <= limit)
            ]
            batch = _prefill_batch(native, layout, block_size)
            torch_only = set(range(len(query_lens))) - set(native)  # the long contexts
        prefills = prefill_spans(starts, query_lens, layout, block_size, device, torch_only)
        meta = NativeDecodeMetadata(
            slot_mapping=layout.slot_mapping.to(device),
            decode_batch=_decode_batch(
                query_lens, layout.seq_lens, layout.block_table, block_size, layout.q_starts, device
            ),
            prefills=prefills,
            prefill_batch=batch,
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
                q, k_cache, v_cache, batch.block_table, batch.seq_lens, self.scale,
                None, self.sliding_window, self.soft_cap,
            )  # fmt: skip
            return out.view(num_tokens, self.num_heads * d)
        out = torch.empty(q.shape, dtype=q.dtype)  # contiguous: q may be a strided view
        if batch is not None:
            qd = q.index_select(0, batch.token_index)
            od = paged_decode_unchecked(
                qd, k_cache, v_cache, batch.block_table, batch.seq_lens, self.scale,
                None, self.sliding_window, self.soft_cap,
            )  # fmt: skip
            out.index_copy_(0, batch.token_index, od)
        prefill = meta.prefill_batch
        if prefill is not None:  # the spans' rows of out, read from the cache in place
            paged_prefill_unchecked(
                q, k_cache, v_cache, prefill.block_table, prefill.q_starts, prefill.q_lens,
                prefill.ctx_starts, self.scale, out=out, sliding_window=self.sliding_window,
                soft_cap=self.soft_cap,
            )  # fmt: skip
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

    @classmethod
    def make_builder(cls, spec: AttentionSpec) -> NativeDecodeMetadataBuilder:
        from replica.layers.cpu_isa import active_level

        return NativeDecodeMetadataBuilder(
            spec.block_size,
            spec.device,
            native_prefill_runs_here(spec),
            native_prefill_max_keys(active_level()),  # the runner builds inside its level
        )


# the instruction-set levels whose build of the prefill kernel has explicit vector code: below
# them (SSE2, or another architecture's plain loops) torch's SDPA was 3-5x faster
VECTOR_PREFILL_LEVELS = ("avx2", "avx512", "avx512_vnni", "avx512_bf16")


def native_prefill_runs_here(spec: AttentionSpec) -> bool:
    """Whether prefills take the native kernel: asked for, and the active level (the runner
    builds inside its own, cpu_isa.use_level) has its vector code."""
    from replica.layers.cpu_isa import active_level

    return spec.cpu_prefill_attention == "native" and active_level() in VECTOR_PREFILL_LEVELS
