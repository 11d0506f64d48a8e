"""What every attention backend provides (as vLLM's AttentionBackend): a metadata type, a builder
that makes it once per step, and an impl each layer calls with it; plus the step layout (positions,
cache slots, block table) all builders start from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, kv_heads, d]


@dataclass(frozen=True)
class AttentionSpec:
    """What picks a backend and sizes its metadata: one rank's attention and KV cache layout."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    cpu_decode_attention: str = "native"  # EngineConfig.cpu_decode_attention
    cpu_prefill_attention: str = "native"  # EngineConfig.cpu_prefill_attention
    cuda_attention: str = "torch"  # EngineConfig.cuda_attention
    num_heads: int = 0  # this rank's query heads (0: as many as its KV heads)
    # the distinct sliding windows of the model's layers (empty: every layer attends fully)
    # and whether any layer soft-caps its scores: a backend that cannot must not be picked
    sliding_windows: tuple[int, ...] = ()
    soft_cap: bool = False

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return max(1, self.num_heads // self.num_kv_heads)


@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each request attends to; shared by all layers. Each
    backend subclasses it with what its impl reads (a model run without a runner uses
    `TorchSDPAMetadata.build`, torch_sdpa.py)."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    # a hybrid model's step: every KV group's metadata, by group (None: one group, this one);
    # not a field, so subclasses' fields stay positional
    groups = None


@dataclass
class StepLayout:
    """The step's requests laid out back to back (CPU tensors; builders move what they keep)."""

    seq_lens: list[int]  # per request: keys it attends to (start + query_len)
    blocks_per_req: list[int]  # per request: blocks its keys span
    block_table: torch.Tensor  # long [B, max_blocks], padded with block 0
    q_lens: torch.Tensor  # long [B]
    q_starts: torch.Tensor  # long [B] index of each request's first token in the flat stream
    positions: torch.Tensor  # long [T]
    slot_mapping: torch.Tensor  # long [T]


def step_layout(
    starts: list[int], query_lens: list[int], block_ids: list[list[int]], block_size: int
) -> StepLayout:
    """Layout of requests whose tokens start..start+n run this step; index tensors are made with
    vector ops, not per token."""
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
    return StepLayout(
        seq_lens, blocks_per_req, block_table, q_lens, q_starts, positions, slot_mapping
    )


class AttentionMetadataBuilder:
    """Makes one backend's metadata, once per step, for every layer."""

    def __init__(self, block_size: int, device: torch.device | str) -> None:
        self.block_size = block_size
        self.device = device

    def bind_cache(self, num_blocks: int, sink: int, max_model_len: int) -> None:
        """The runner's KV cache was (re)allocated: `num_blocks` blocks for the scheduler and,
        for a backend with needs_sink_block, block `sink` after them. Most keep nothing."""

    def build(
        self, starts: list[int], query_lens: list[int], block_ids: list[list[int]]
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """The metadata of requests whose tokens start..start+n run this step, laid out back to
        back, and the positions tensor [T]."""
        raise NotImplementedError


class AttentionImpl:
    """One layer's attention on one backend: q [T, num_heads, d] against the paged cache, which
    holds the step's new K/V (k, v [T, num_kv_heads, d]) already; returns [T, num_heads * d].
    sliding_window: a query at position p sees keys p - window < j <= p (None: all j <= p);
    soft_cap: scores become soft_cap * tanh(scores / soft_cap) before the softmax."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.group = num_heads // num_kv_heads  # query heads per KV head
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError


class AttentionBackend:
    """One way to run attention. A backend is a new module defining a subclass, listed in
    selector.py's ATTENTION_BACKENDS; the runner picks one at construction."""

    name: ClassVar[str]
    # True: the runner allocates one KV block past the scheduler's, the sink padding lanes
    # write to (and read), and gives it to the builder's bind_cache
    needs_sink_block: ClassVar[bool] = False
    builder_cls: ClassVar[type[AttentionMetadataBuilder]]
    impl_cls: ClassVar[type[AttentionImpl]]

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        """True when this backend can run `spec` (device, dtype, block size, kernels present)."""
        raise NotImplementedError

    @classmethod
    def make_builder(cls, spec: AttentionSpec) -> AttentionMetadataBuilder:
        return cls.builder_cls(spec.block_size, spec.device)

    @classmethod
    def make_impl(
        cls,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> AttentionImpl:
        return cls.impl_cls(num_heads, num_kv_heads, head_dim, scale, sliding_window, soft_cap)
