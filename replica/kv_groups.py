"""Which layers share a KV block table: one KV group per distinct sliding window when a model's
layers differ (Gemma 2, Gemma 3), so a windowed group's blocks behind its window can be freed
while a full-attention group keeps all of its own (replica/kv_hybrid.py). As in vLLM, every
group has the same number of layers (a window's layers are cut into groups of the smallest
window's count, the last maybe shorter) and layer j of every group shares cache tensor j: a
block id is the same bytes in every group, so all groups draw from one pool of block ids."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: the cache tensor it uses
    num_slots: int  # cache tensors (layers per group)

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1


def kv_groups(layer_windows: list[int | None]) -> KVGroups:
    """The KV groups of layers with these windows: one group of every layer when they share a
    window (or none has one); otherwise full-attention groups first (group 0's hashes are the
    ones KV events report), then by window."""
    n = len(layer_windows)
    distinct = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
    if len(distinct) == 1:
        return KVGroups((distinct[0],), (0,) * n, tuple(range(n)), n)
    layers_of = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in distinct}
    size = min(len(v) for v in layers_of.values())
    windows: list[int | None] = []
    group, slot = [0] * n, [0] * n
    for w in distinct:
        layers = layers_of[w]
        for first in range(0, len(layers), size):
            for j, layer in enumerate(layers[first : first + size]):
                group[layer], slot[layer] = len(windows), j
            windows.append(w)
    return KVGroups(tuple(windows), tuple(group), tuple(slot), size)


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on fresh anonymous memory: the OS hands out zeroed pages as each is
    first touched, so nothing is written up front (torch.zeros wrote the default 1 GiB KV cache
    at start-up: 0.6-0.9 s on a 2-core host), and only the blocks in use become resident. The
    tensor keeps its mapping alive."""
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(size, 1))  # MAP_ANONYMOUS | MAP_PRIVATE: zero-filled by the OS
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def allocate_caches(
    groups: KVGroups, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V cache of `shape` (zeros: padded decode lanes read slots, and NaN
    garbage would leak through); layer j of every group shares tensor pair j."""
    if device.type == "cpu":
        slots = [
            (zero_pages(shape, dtype), zero_pages(shape, dtype)) for _ in range(groups.num_slots)
        ]
    else:
        slots = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(groups.num_slots)
        ]
    return [slots[j] for j in groups.layer_slot]


def group_metadata(builder, meta, starts, query_lens, group_block_ids) -> None:
    """A hybrid model's step: `meta` (group 0's, built from its tables) gets `groups`, every
    group's metadata in order, each built from that group's tables; a layer of group g reads
    meta.groups[g] (layers/attention/layer.py)."""
    meta.groups = [meta]
    for tables in group_block_ids:
        meta.groups.append(builder.build(starts, query_lens, tables)[0])
