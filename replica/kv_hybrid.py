"""KV blocks of a hybrid model (Gemma 2, Gemma 3: layers of different sliding windows), as vLLM's
hybrid KV cache manager: the layers form KV groups of one window each (replica/kv_groups.py),
every group has its own block table per request, covering the same positions with the same
block hashes, and all groups draw from one pool of block ids (a block id is the same bytes in
every group: each group has as many layers, and layer j of every group shares cache tensor j).
A full-attention group keeps every block; a windowed group frees its blocks wholly behind its
window, as KVCacheManager does for an all-windowed model. Allocation is all-or-nothing across
groups, so preemption and admission work as with one table.

Prefix caching: group g caches a block under (g, hash) (group 0 under the hash alone, which
KV events report); a hit of k blocks needs, in every group, the blocks the next token's window
reaches (all k in a full-attention group), each still cached, so its data is intact."""

from __future__ import annotations

from replica.kv_cache import BlockPool, KVBlock, KVCacheManager, check_pool
from replica.request import Request


class HybridKVCacheManager:
    """KVCacheManager's interface over several KV groups sharing one pool; `block_ids` is group
    0's table (a full-attention group's when there is one) and `group_block_ids` the others'."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        group_windows: tuple[int | None, ...],
    ) -> None:
        if len(group_windows) < 2:
            raise ValueError("a hybrid KV manager needs at least two groups")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = [
            KVCacheManager(num_blocks, block_size, enable_caching, w, pool=self.pool, group=g)
            for g, w in enumerate(group_windows)
        ]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_window_freed_blocks(self) -> int:
        return sum(g.num_window_freed_blocks for g in self.groups)

    def max_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a request of up to `num_tokens` may hold at once, running at most
        `step_tokens` a step: every block in a full-attention group, a windowed group's window
        (less its last key) and a step's tokens, unaligned."""
        bs = self.block_size
        whole = -(-num_tokens // bs)
        return sum(
            whole if g.sliding_window is None
            else min(whole, -(-(g.sliding_window - 1 + step_tokens) // bs) + 1)
            for g in self.groups
        )  # fmt: skip

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock | None]], int]:
        """The longest cached prefix of k full blocks that every group can resume from: a
        full-attention group holds all k cached, a windowed group the blocks its window
        reaches from position k * block_size (the next token); earlier ones are None. Returns
        one hit list per group and the hit's tokens."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        hashes = request.block_hashes[: (request.num_tokens - 1) // bs]
        pool = self.pool
        found = []
        k = len(hashes)
        for g in self.groups:
            blocks = [pool.get_cached_block(h, g.group) for h in hashes]
            if g.sliding_window is None:
                k = min(k, next((i for i, b in enumerate(blocks) if b is None), len(blocks)))
            found.append(blocks)
        while k > 0 and not all(
            all(b is not None for b in blocks[self._first_needed(g, k) : k])
            for g, blocks in zip(self.groups, found)
        ):
            k -= 1
        if k == 0:
            return [], 0
        hits = []
        for g, blocks in zip(self.groups, found):
            first = self._first_needed(g, k)
            hits.append([None] * first + blocks[first:k])
        return hits, k * bs

    def _first_needed(self, group: KVCacheManager, num_blocks: int) -> int:
        """The first block a query at position num_blocks * block_size reads in `group`."""
        if group.sliding_window is None:
            return 0
        return max(0, num_blocks * self.block_size - group.sliding_window + 1) // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVBlock | None]] | None = None,
    ) -> list[KVBlock] | None:
        """KVCacheManager.allocate_slots over every group at once: the new blocks of all
        groups, or None (nothing allocated in any group) when the pool cannot supply them."""
        hits = new_computed_blocks or [None] * len(self.groups)
        plans = [g.plan(request, num_new_tokens, h) for g, h in zip(self.groups, hits)]
        need = sum(p[0] for p in plans if p is not None)
        # every group's hits on free blocks come off the free list: they count as taken
        evictable = sum(p[1] for p in plans if p is not None)
        if need > self.pool.num_free_blocks - evictable:
            return None
        # every hit off the free list first: a group's new blocks must not evict another's hit
        for h, p in zip(hits, plans):
            if p is not None and h:
                self.pool.touch(b for b in h if b is not None)
        new_blocks: list[KVBlock] = []
        for g, h, p in zip(self.groups, hits, plans):
            if p is not None:
                new_blocks += g.commit(request, num_new_tokens, h, p[0], touched=True)
        return new_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].block_ids(request_id)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The tables of groups 1.. (live lists, as block_ids)."""
        return [g.block_ids(request_id) for g in self.groups[1:]]

    def num_held_blocks(self, request_id: str) -> int:
        return sum(g.num_held_blocks(request_id) for g in self.groups)

    def in_flight_shared(self, request: Request, num_computed: int) -> bool:
        return any(g.in_flight_shared(request, num_computed) for g in self.groups)

    def uncache_in_flight(self, request: Request, num_computed: int) -> None:
        for g in self.groups:
            g.uncache_in_flight(request, num_computed)

    def free(self, request: Request) -> None:
        # windowed groups first: the full group's blocks (the likeliest prefix hits) are
        # evicted last
        for g in reversed(self.groups):
            g.free(request)

    def check_invariants(self) -> None:
        """The pool's books against every group's tables; no block in two groups (nor cached
        under another group's key); every group covers the same positions of the same
        requests."""
        holders: dict[int, int] = {}
        owner: dict[int, int] = {}
        for g in self.groups:
            for block_id, n in g.holders().items():
                holders[block_id] = holders.get(block_id, 0) + n
                # a block holds one group's layers: two groups never share it
                assert owner.setdefault(block_id, g.group) == g.group, f"block {block_id} shared"
                key = self.pool.blocks[block_id].block_hash
                assert key is None or (key[0] if isinstance(key, tuple) else 0) == g.group
        check_pool(self.pool, holders)
        first = self.groups[0]
        for g in self.groups[1:]:
            assert g.req_to_blocks.keys() == first.req_to_blocks.keys(), "groups' requests differ"
            for rid, blocks in g.req_to_blocks.items():
                assert len(blocks) == len(first.req_to_blocks[rid]), f"{rid}: tables' lengths"
