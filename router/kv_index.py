"""The router's mirror of every replica's prefix cache, fed by the replicas' KV events
(replica/kv_events.py): block hash -> the replicas holding it, exact as of each replica's last
applied batch. For a prompt, `hit_tokens` says how many of its tokens each replica would find
cached: the prompt's chained block hashes are computed with the replica's own function
(`replica.request.extend_block_hashes`) from the root of the request's LoRA adapter
(`root_block_hash`: KV computed under an adapter is hashed from its own root, so an adapter
request hits only blocks computed under the same adapter), so the prediction is the replica's own lookup
(`KVCacheManager.get_computed_blocks`) run on the mirror.

A replica's view advances one batch at a time; a batch whose number is not the next one (a
lost batch) leaves the view `stale`, predicting no hits, until a snapshot replaces it. A replica
that leaves (dead, replaced, scaled down) is dropped with `remove_replica`.

Memory: one dict entry per distinct cached block across the fleet (a bit mask of holders as the
value), so it is bounded by the fleet's KV blocks; a replica whose view would exceed
`max_blocks_per_replica` is dropped (and counted) rather than let grow.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from replica.api import (
    CLEARED,
    REMOVED,
    STORED,
    KVEventBatch,
    KVSnapshot,
    LoRARequest,
    extend_block_hashes,
    root_block_hash,
)


@dataclass
class _View:
    bit: int
    seq: int = 0
    num_blocks: int = 0
    stale: bool = False  # a batch was missed: no predictions until a snapshot


class KVIndex:
    def __init__(self, block_size: int, max_blocks_per_replica: int = 1 << 22) -> None:
        self.block_size = block_size
        self.max_blocks_per_replica = max_blocks_per_replica
        self._holders: dict[int, int] = {}  # block hash -> bit mask of replicas
        self._views: dict[str, _View] = {}
        self._by_bit: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._lock = threading.Lock()
        # counters (the router exports them)
        self.events_applied = 0
        self.batches_applied = 0
        self.gaps = 0
        self.snapshots = 0
        self.overflows = 0

    # -- replicas ------------------------------------------------------------------------------
    def _view(self, replica_id: str) -> _View:
        view = self._views.get(replica_id)
        if view is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = 1 << self._next_bit
                self._next_bit += 1
            view = self._views[replica_id] = _View(bit)
            self._by_bit[bit] = replica_id
        return view

    def _clear_view(self, view: _View) -> None:
        if view.num_blocks == 0:
            return
        keep = ~view.bit
        holders = self._holders
        for h in [h for h, mask in holders.items() if mask & view.bit]:
            mask = holders[h] & keep
            if mask:
                holders[h] = mask
            else:
                del holders[h]
        view.num_blocks = 0

    def remove_replica(self, replica_id: str) -> None:
        with self._lock:
            view = self._views.pop(replica_id, None)
            if view is None:
                return
            self._clear_view(view)
            del self._by_bit[view.bit]
            self._free_bits.append(view.bit)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Drop every replica not in `replica_ids` (the live set)."""
        alive = set(replica_ids)
        for rid in [r for r in self._views if r not in alive]:
            self.remove_replica(rid)

    def replicas(self) -> list[str]:
        return list(self._views)

    def seq(self, replica_id: str) -> int | None:
        """The last batch applied for the replica; None when it needs a snapshot (unknown or
        stale)."""
        view = self._views.get(replica_id)
        if view is None or view.stale:
            return None
        return view.seq

    # -- updates ---------------------------------------------------------------------------
    def apply(self, replica_id: str, batch: KVEventBatch) -> bool:
        """Apply one batch; False (and the view goes stale) when it is not the next one."""
        with self._lock:
            view = self._view(replica_id)
            if view.stale:
                return False
            if batch.seq <= view.seq:
                return True  # already applied (a duplicate delivery)
            if batch.seq != view.seq + 1:
                view.stale = True
                self.gaps += 1
                self._clear_view(view)
                return False
            holders = self._holders
            bit = view.bit
            keep = ~bit
            n = view.num_blocks
            for event in batch.events:
                kind = event[0]
                if kind == STORED:
                    h = event[1]
                    mask = holders.get(h, 0)
                    if not mask & bit:
                        holders[h] = mask | bit
                        n += 1
                elif kind == REMOVED:
                    h = event[1]
                    mask = holders.get(h, 0)
                    if mask & bit:
                        mask &= keep
                        if mask:
                            holders[h] = mask
                        else:
                            del holders[h]
                        n -= 1
                elif kind == CLEARED:
                    view.num_blocks = n
                    self._clear_view(view)
                    n = 0
            view.num_blocks = n
            view.seq = batch.seq
            self.events_applied += len(batch.events)
            self.batches_applied += 1
            if n > self.max_blocks_per_replica:
                self.overflows += 1
                view.stale = True
                self._clear_view(view)
                return False
            return True

    def load_snapshot(self, replica_id: str, snapshot: KVSnapshot) -> None:
        """Replace the replica's view with its whole table as of batch `snapshot.seq`."""
        with self._lock:
            view = self._view(replica_id)
            self._clear_view(view)
            holders = self._holders
            bit = view.bit
            for h in snapshot.blocks:
                holders[h] = holders.get(h, 0) | bit
            view.num_blocks = len(snapshot.blocks)
            view.seq = snapshot.seq
            view.stale = False
            self.snapshots += 1

    # -- queries ---------------------------------------------------------------------------
    def prompt_hashes(self, token_ids: Sequence[int], lora: LoRARequest | None = None) -> list[int]:
        """The prompt's chained block hashes that a hit can cover, from the root of its adapter
        `lora` (None: the base model): full blocks, at most (len - 1) // block_size of them (the
        last token is always computed, as in `KVCacheManager.get_computed_blocks`)."""
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        return extend_block_hashes(
            [], list(token_ids[:usable]), self.block_size, root_block_hash(lora)
        )

    def hit_tokens(
        self, hashes: Sequence[int], replica_ids: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Per replica (of `replica_ids`, default all known) that holds at least the prompt's
        first block, the prompt tokens it has cached: the longest run of the prompt's leading
        blocks in its view (replicas left out hold none; stale views count as none). Costs
        O(prompt blocks) big-int operations, however many replicas there are."""
        with self._lock:
            views = self._views
            if replica_ids is None:
                ids = list(views)
            else:
                ids = [r for r in replica_ids if r in views]
            out: dict[str, int] = {}
            alive = 0
            for rid in ids:
                view = views[rid]
                if not view.stale:
                    alive |= view.bit
            holders = self._holders
            bs = self.block_size
            for i, h in enumerate(hashes):
                if not alive:
                    break
                still = holders.get(h, 0) & alive
                dropped = alive & ~still
                while dropped and i:
                    low = dropped & -dropped
                    out[self._by_bit[low]] = i * bs
                    dropped ^= low
                alive = still
            n = len(hashes) * bs
            while alive:
                low = alive & -alive
                out[self._by_bit[low]] = n
                alive ^= low
            return out

    def blocks_of(self, replica_id: str) -> set[int]:
        """The hashes the view holds for `replica_id` (tests compare it with the replica)."""
        view = self._views.get(replica_id)
        if view is None:
            return set()
        return {h for h, mask in self._holders.items() if mask & view.bit}

    @property
    def num_entries(self) -> int:
        """Distinct block hashes in the index."""
        return len(self._holders)

    def num_blocks(self, replica_id: str) -> int:
        view = self._views.get(replica_id)
        return view.num_blocks if view else 0

    def stats(self) -> dict:
        return {
            "entries": self.num_entries,
            "replicas": len(self._views),
            "stale_replicas": sum(v.stale for v in self._views.values()),
            "events_applied": self.events_applied,
            "batches_applied": self.batches_applied,
            "gaps": self.gaps,
            "snapshots": self.snapshots,
            "overflows": self.overflows,
        }
