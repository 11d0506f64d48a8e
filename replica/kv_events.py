"""KV-cache events: what a replica's prefix cache gained and lost, for routers that mirror it
(router/kv_index.py), as vLLM's KV events feed llm-d's precise prefix-cache scorer.

The block pool (replica/kv_cache.py) reports every change to its table of cached block hashes,
the set a prefix-cache lookup searches: a hash entering it (`stored`, with its parent's hash),
a hash leaving it (`removed`: its block was evicted for reuse), the whole table emptied
(`cleared`). The engine seals what a step produced into one numbered batch (`KVEventLog.seal`,
sequence numbers 1, 2, 3, ... per replica, never skipping), so a reader that sees a number
jump knows it missed a batch and needs a snapshot (`KVEventLog.snapshot`): the table as of the
last sealed batch.

Events are plain tuples (cheap to make on the engine thread, cheap to pickle):
    (STORED, hash, parent hash, tokens)    parent is ROOT_BLOCK_HASH for a prompt's first block
    (REMOVED, hash)
    (CLEARED,)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STORED, REMOVED, CLEARED = 0, 1, 2

# a replica is read while a router polled for it this recently (routers poll every 50 ms when
# busy, every 0.5 s when idle); one no router reads stops publishing (kv_publisher.py)
READ_TTL_S = 5.0


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One step's changes on one replica, in order."""

    seq: int
    events: tuple[tuple, ...]


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """A replica's whole cached-hash table as of batch `seq` ({hash: parent hash})."""

    seq: int
    blocks: dict[int, int] = field(default_factory=dict)


class KVEventLog:
    """Collects the block pool's events between seals. Mirrors the pool's table itself
    ({hash: parent}) so that a snapshot needs nothing from the pool."""

    __slots__ = ("_pending", "seq", "table", "num_events", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pending: list[tuple] = []
        self.seq = 0  # of the last sealed batch
        self.table: dict[int, int] = {}
        self.num_events = 0

    def stored(self, block_hash: int, parent: int) -> None:
        self._pending.append((STORED, block_hash, parent, self.block_size))
        self.table[block_hash] = parent

    def removed(self, block_hash: int) -> None:
        self._pending.append((REMOVED, block_hash))
        self.table.pop(block_hash, None)

    def cleared(self) -> None:
        self._pending.append((CLEARED,))
        self.table.clear()

    def seal(self) -> KVEventBatch | None:
        """The events since the last seal as the next batch (None when there are none)."""
        if not self._pending:
            return None
        self.seq += 1
        self.num_events += len(self._pending)
        batch = KVEventBatch(self.seq, tuple(self._pending))
        self._pending = []
        return batch

    def snapshot(self) -> KVSnapshot:
        """The table as of the last sealed batch (call it between steps: right after `seal`)."""
        if self._pending:
            raise RuntimeError("snapshot with unsealed events: seal first")
        return KVSnapshot(self.seq, dict(self.table))


class KVEventHub:
    """The meeting point of one application's replicas (publishers) and routers (readers), a
    named Ray actor (`get_kv_hub`). It keeps, per replica, the table as of its last batch and
    the last `keep_batches` batches, so that a router catching up gets the batches it missed,
    or a snapshot when they are gone. A replica it does not know, or whose batches skip a
    number, is asked to resync (a snapshot in its next publish). Replicas silent for
    `forget_after_s` (publishers send a heartbeat) are dropped.

    It also knows which replicas are read: a router polls only while it has two replicas or
    more to choose from (router/kv_routing.py), and `is_read` tells a replica whether any
    router polled for it in the last READ_TTL_S, so that a replica alone in its application
    publishes nothing (replica/kv_publisher.py)."""

    def __init__(self, keep_batches: int = 1024, forget_after_s: float = 60.0) -> None:
        self.keep_batches = keep_batches
        self.forget_after_s = forget_after_s
        self._replicas: dict[str, dict] = {}
        self._read_at: dict[str, float] = {}  # replica -> when a router last polled for it

    def publish(
        self,
        replica_id: str,
        batches: list[KVEventBatch],
        snapshot: KVSnapshot | None = None,
        now: float | None = None,
    ) -> dict:
        now = time.time() if now is None else now
        entry = self._replicas.get(replica_id)
        if snapshot is not None:
            entry = self._replicas[replica_id] = {
                "seq": snapshot.seq,
                "table": dict(snapshot.blocks),
                "batches": [],
                "seen": now,
            }
        elif entry is None:
            if not batches or batches[0].seq != 1:
                return {"resync": True}
            entry = self._replicas[replica_id] = {"seq": 0, "table": {}, "batches": [], "seen": now}
        entry["seen"] = now
        table = entry["table"]
        kept = entry["batches"]
        for batch in batches:
            if batch.seq <= entry["seq"]:
                continue
            if batch.seq != entry["seq"] + 1:
                del self._replicas[replica_id]
                return {"resync": True}
            for event in batch.events:
                if event[0] == STORED:
                    table[event[1]] = event[2]
                elif event[0] == REMOVED:
                    table.pop(event[1], None)
                else:
                    table.clear()
            entry["seq"] = batch.seq
            kept.append(batch)
        if len(kept) > self.keep_batches:
            del kept[: len(kept) - self.keep_batches]
        self._forget_silent(now)
        return {"resync": False}

    def _forget_silent(self, now: float) -> None:
        for rid in [r for r, e in self._replicas.items() if now - e["seen"] > self.forget_after_s]:
            del self._replicas[rid]

    def poll(
        self, cursors: dict[str, int], now: float | None = None
    ) -> dict[str, tuple[str, object]]:
        """For each replica in `cursors` (its value: the last batch the caller applied, -1 for
        none) that has news: ("batches", [...]) when the hub still holds every batch after the
        cursor, else ("snapshot", KVSnapshot); ("gone", None) for a replica the hub dropped.
        Each replica in `cursors` counts as read (`is_read`)."""
        now = time.time() if now is None else now
        out: dict[str, tuple[str, object]] = {}
        for rid, cursor in cursors.items():
            self._read_at[rid] = now
            entry = self._replicas.get(rid)
            if entry is None:
                if cursor >= 0:
                    out[rid] = ("gone", None)
                continue
            if cursor == entry["seq"]:
                continue
            kept = entry["batches"]
            if 0 <= cursor < entry["seq"] and kept and kept[0].seq <= cursor + 1:
                out[rid] = ("batches", [b for b in kept if b.seq > cursor])
            else:
                out[rid] = ("snapshot", KVSnapshot(entry["seq"], dict(entry["table"])))
        return out

    def is_read(self, replica_id: str, now: float | None = None) -> bool:
        """Whether a router polled for `replica_id` in the last READ_TTL_S."""
        now = time.time() if now is None else now
        self._read_at = {r: t for r, t in self._read_at.items() if now - t <= READ_TTL_S}
        return replica_id in self._read_at

    def forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def replicas(self) -> dict[str, int]:
        return {rid: e["seq"] for rid, e in self._replicas.items()}


def call_hub(hub, method: str, *args, wait: bool = True):
    """Call `method` on a hub: its Ray actor handle (waiting for the answer unless `wait` is
    False), or a KVEventHub in this process (tests)."""
    call = getattr(hub, method)
    if not hasattr(call, "remote"):
        return call(*args)
    import ray

    ref = call.remote(*args)
    return ray.get(ref, timeout=30) if wait else None
