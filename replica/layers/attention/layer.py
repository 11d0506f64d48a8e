"""The attention layer the models build: it writes the step's K/V to the cache, then runs the
impl of the backend the runner chose."""

from __future__ import annotations

import torch
from torch import nn

from replica.layers.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from replica.layers.attention.torch_sdpa import TorchSDPABackend
from replica.layers.cpu_kernels import kv_write


class Attention(nn.Module):
    """Attention of this rank's heads; q/k/v come in flat [T, heads * head_dim]. Writes the new
    K/V to their cache slots, then runs the backend's impl: torch SDPA until `use_backend` picks
    another; the step's metadata must be that backend's. sliding_window: a query at position p
    sees keys p - window < j <= p (None: every earlier key); logits_soft_cap: scores become
    cap * tanh(scores / cap) before the softmax (None: as they are)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = check_sliding_window(sliding_window)
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap}")
        self.logits_soft_cap = logits_soft_cap
        self.kv_group = 0  # a hybrid model's KV group (replica/kv_groups.py): its metadata
        self.backend: type[AttentionBackend] = TorchSDPABackend
        self.use_backend(TorchSDPABackend)

    fused_cpu_ops = False  # set by the runner: the K/V cache writes by one C call on CPU

    def use_backend(self, backend: type[AttentionBackend]) -> None:
        self.backend = backend
        self.impl = backend.make_impl(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
        )

    def set_sliding_window(self, window: int | None) -> None:
        """This layer's window (a model sets it per layer after building them)."""
        self.sliding_window = check_sliding_window(window)
        self.use_backend(self.backend)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.kv_group:  # group 0 reads the step's metadata itself
            meta = meta.groups[self.kv_group]
        num_tokens = q.shape[0]
        d = self.head_dim
        q = q.view(num_tokens, self.num_heads, d)
        k = k.view(num_tokens, self.num_kv_heads, d)
        v = v.view(num_tokens, self.num_kv_heads, d)
        k_cache, v_cache = kv_cache
        # every new K/V first, so a request may read blocks another request writes this step
        # (a prefix-cache hit on a block being filled in the same step); the cache layout is the
        # runner's, the same for every backend
        if not (self.fused_cpu_ops and kv_write(k, v, meta.slot_mapping, k_cache, v_cache)):
            k_cache.view(-1, self.num_kv_heads, d).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, self.num_kv_heads, d).index_copy_(0, meta.slot_mapping, v)
        return self.impl.forward(q, k, v, kv_cache, meta)


def check_sliding_window(window: int | None) -> int | None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    return window


def set_attention_backend(model: nn.Module, backend: type[AttentionBackend]) -> int:
    """Point every Attention layer of `model` at `backend`; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.use_backend(backend)
    return len(layers)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's Attention layers, in layer order."""
    return [m for m in model.modules() if isinstance(m, Attention)]
