"""The KV tiers below the pool (docs/kv-transfer.md): blocks evicted from the pool are kept in host
memory (and below it on local disk) under the same block hashes, and copied back instead of
recomputed; blocks imported from another replica are staged in the same host tier.

Two halves, as the pool's: `KVTierIndex` (the scheduler's: which hashes each tier holds, LRU by
bytes; it decides every move and emits it as an op) and `KVTierStore` (each runner rank's: the
bytes, moved by the ops in the order they come, before the step's forward). The ops ride the
step (SchedulerOutput.kv_ops, StepBatch.kv_ops), so every tensor-parallel rank moves its own
share of the same blocks."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# op kinds: (kind, block hash, block id)
SAVE = 1  # copy pool block `block id` into the host tier under `hash` (it is being evicted)
RESTORE = 2  # copy the tier's `hash` into pool block `block id` and forget it in the tier
DEMOTE = 3  # move `hash` from host memory to disk
DROP = 4  # forget `hash` in whichever tier holds it

HOST, DISK = "host", "disk"
# imports are staged in the host tier even when kv_offload_bytes is 0: up to this many blocks
DEFAULT_STAGING_BLOCKS = 256


class KVTierIndex:
    """Which block hashes the tiers hold, LRU by bytes (the scheduler's view; no tensors).
    host_blocks: the host tier's capacity for evicted blocks (kv_offload_bytes // block bytes);
    staging_blocks: its capacity for imports when that is larger; disk_blocks: the disk tier's
    (0: none)."""

    def __init__(self, host_blocks: int, disk_blocks: int = 0, staging_blocks: int = 0) -> None:
        self.spill = host_blocks > 0  # evicted pool blocks are saved (else imports only)
        self.host_capacity = max(host_blocks, staging_blocks)
        self.disk_capacity = disk_blocks if self.spill else 0
        self.host: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.disk: OrderedDict[int, None] = OrderedDict()
        self.ops: list[tuple[int, int, int]] = []  # emitted since the last take_ops
        self._taken: dict[int, OrderedDict] = {}  # taken by `take`, by the tier they left
        # totals since start
        self.num_saves = 0
        self.num_restores = 0
        self.num_imported = 0
        self.num_demoted = 0
        self.num_dropped = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.host or block_hash in self.disk

    def __len__(self) -> int:
        return len(self.host) + len(self.disk)

    def where(self, block_hash: int) -> str | None:
        return HOST if block_hash in self.host else DISK if block_hash in self.disk else None

    def take_ops(self) -> list[tuple[int, int, int]]:
        ops, self.ops = self.ops, []
        return ops

    def save(self, block_hash: int, block_id: int) -> None:
        """A cached pool block is being evicted: keep its contents (when spilling is on)."""
        if not self.spill or block_hash in self:
            return
        self.ops.append((SAVE, block_hash, block_id))
        self.num_saves += 1
        self._insert(block_hash)

    def staged(self, block_hash: int) -> bool:
        """An imported block's bytes were put in every rank's host tier (KVTierStore.put):
        index it. False when the host tier has no room at all."""
        if self.host_capacity < 1:
            return False
        if block_hash in self:  # the same bytes (hashes chain the tokens): now MRU
            self.host.pop(block_hash, None)
            self.disk.pop(block_hash, None)
        self.num_imported += 1
        self._insert(block_hash)
        return True

    def _insert(self, block_hash: int) -> None:
        self.host[block_hash] = None
        while len(self.host) > self.host_capacity:
            old, _ = self.host.popitem(last=False)
            if self.disk_capacity > 0:
                self.disk[old] = None
                self.ops.append((DEMOTE, old, -1))
                self.num_demoted += 1
                while len(self.disk) > self.disk_capacity:
                    gone, _ = self.disk.popitem(last=False)
                    self.ops.append((DROP, gone, -1))
                    self.num_dropped += 1
            else:
                self.ops.append((DROP, old, -1))
                self.num_dropped += 1

    def take(self, hashes: list[int]) -> list[int]:
        """The leading run of `hashes` the tiers hold, taken out of the index (so no save in
        the same allocation pushes them out); `restore` or `put_back` them next."""
        run = []
        for h in hashes:
            where = self.host if h in self.host else self.disk if h in self.disk else None
            if where is None:
                break
            del where[h]
            self._taken[h] = where
            run.append(h)
        return run

    def put_back(self, hashes: list[int]) -> None:
        """Taken hashes not restored after all (the allocation failed): as they were, MRU.
        Their bytes never left the store (no op was emitted for them)."""
        for h in hashes:
            self._taken.pop(h)[h] = None

    def restore(self, hashes: list[int], block_ids: list[int]) -> None:
        """Taken hashes go into these pool blocks (the op copies them in before the forward)."""
        for h, b in zip(hashes, block_ids):
            self._taken.pop(h, None)
            self.ops.append((RESTORE, h, b))
        self.num_restores += len(hashes)


class KVTierStore:
    """One runner rank's tier bytes: per block hash, the block's K and V over every layer of this
    rank (a CPU tensor [layers, 2, block_size, kv_heads, head_dim]), in host memory or in a file
    under `disk_dir`. It moves what the ops say and holds no limits of its own (the index's)."""

    def __init__(self, kv_caches: list, disk_dir: str | None = None, rank: int = 0) -> None:
        self.kv_caches = kv_caches
        self.host: dict[int, torch.Tensor] = {}
        self.disk_dir = None
        if disk_dir:
            self.disk_dir = Path(disk_dir) / f"pid{os.getpid()}-rank{rank}"
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.disk: set[int] = set()

    def _path(self, block_hash: int) -> Path:
        return self.disk_dir / f"{block_hash & (2**64 - 1):016x}.kv"

    def read_block(self, block_id: int) -> torch.Tensor:
        """Pool block `block_id`'s K and V over every layer, copied to a CPU tensor."""
        out = torch.stack([torch.stack((k[block_id], v[block_id])) for k, v in self.kv_caches])
        return out.to("cpu", copy=True)

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        for (k, v), layer in zip(self.kv_caches, data):
            k[block_id].copy_(layer[0])
            v[block_id].copy_(layer[1])

    def get(self, block_hash: int) -> torch.Tensor | None:
        data = self.host.get(block_hash)
        if data is None and block_hash in self.disk:
            data = torch.load(self._path(block_hash), weights_only=True)
        return data

    def put(self, block_hash: int, data: torch.Tensor) -> None:
        self.host[block_hash] = data

    def apply(self, ops) -> None:
        """Carry out the index's ops, in order (before the step's forward overwrites a block
        that was evicted)."""
        for kind, block_hash, block_id in ops:
            if kind == SAVE:
                self.host[block_hash] = self.read_block(block_id)
            elif kind == RESTORE:
                data = self.get(block_hash)
                if data is None:  # the index never restores what it does not hold
                    raise RuntimeError(f"KV tier has no block {block_hash:#x} to restore")
                self.write_block(block_id, data)
                self._drop(block_hash)
            elif kind == DEMOTE:
                data = self.host.pop(block_hash, None)
                if data is not None and self.disk_dir is not None:
                    torch.save(data, self._path(block_hash))
                    self.disk.add(block_hash)
            elif kind == DROP:
                self._drop(block_hash)

    def _drop(self, block_hash: int) -> None:
        self.host.pop(block_hash, None)
        if block_hash in self.disk:
            self.disk.discard(block_hash)
            self._path(block_hash).unlink(missing_ok=True)

    def close(self) -> None:
        for h in list(self.disk):
            self._drop(h)
        self.host.clear()
        if self.disk_dir is not None:
            try:
                self.disk_dir.rmdir()
            except OSError:
                pass
