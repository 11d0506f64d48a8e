"""Paged KV-cache bookkeeping: BlockPool (ref counts, LRU free list, prefix hash table) and
KVCacheManager (which blocks each request holds). No tensors here: the runner owns those.

For a model whose every layer attends through the same sliding window (Mistral), a running
request's blocks wholly before its window go back to the pool: its block table keeps their
positions, holding NULL_BLOCK_ID (attention masks those keys out, so whatever block 0 holds is
never seen). A freed block keeps its prefix-cache hash until it is reused, and its contents stay
valid until then, so a later prefix hit on it is exact."""

from __future__ import annotations

from collections.abc import Iterable

from replica.kv_events import KVEventLog
from replica.kv_tier import KVTierIndex
from replica.request import ROOT_BLOCK_HASH, Request

NULL_BLOCK_ID = 0  # a freed window block's place in a block table


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | tuple[int, int] | None = None  # its key in BlockPool.cached
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks in eviction order (head = evicted first).

    Blocks carry their own links, so removing a block from the middle (a prefix-cache hit on a
    free block) is O(1).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of one replica: allocation, ref counting, prefix-cache lookup, eviction."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        # every change to `cached` is reported here once events are on (replica/kv_events.py)
        self.events: KVEventLog | None = None
        # the tiers below the pool (kv_tier.py): an evicted cached block is saved there
        self.tier: KVTierIndex | None = None

    def enable_events(self, block_size: int) -> KVEventLog:
        """Start reporting changes to the cached-hash table; the table's current contents
        arrive as stored events in the first batch."""
        if self.events is None:
            self.events = KVEventLog(block_size)
            for key in self.cached:
                if isinstance(key, int):  # group 0's blocks only (see cache_block)
                    self.events.stored(key, ROOT_BLOCK_HASH)
        return self.events

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def get_cached_block(self, block_hash: int, group: int = 0) -> KVBlock | None:
        return self.cached.get(block_hash if not group else (group, block_hash))

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            key = block.block_hash
            if self.tier is not None and isinstance(key, int) and self.cached.get(key) is block:
                self.tier.save(key, block.block_id)  # copied out before the step's forward
            self.uncache_block(block)  # evict: its old contents are about to be overwritten
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block takes it off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free list's tail in this order."""
        for block in ordered:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def uncache_block(self, block: KVBlock) -> None:
        """Forget a block's hash (evicted, or its contents never computed): no lookup finds it."""
        if block.block_hash is None:
            return
        key = block.block_hash
        if self.cached.get(key) is block:
            del self.cached[key]
            if self.events is not None and isinstance(key, int):
                self.events.removed(key)
        block.block_hash = None

    def cache_block(
        self, block: KVBlock, block_hash: int, parent: int = ROOT_BLOCK_HASH, group: int = 0
    ) -> None:
        """Cache `block` under its hash in KV group `group` (kv_hybrid.py): group 0's key is the
        hash itself, and only its blocks are reported as events (the other groups hold the same
        positions, so the router's prefix index loses nothing); another group's key is
        (group, hash), as the same tokens' blocks of two groups hold different layers."""
        if not self.enable_caching or block.block_hash is not None:
            return
        key = block_hash if not group else (group, block_hash)
        block.block_hash = key
        # first writer wins: an identical block already cached stays the canonical one
        if key not in self.cached:
            self.cached[key] = block
            if self.events is not None and not group:
                self.events.stored(block_hash, parent)


class KVCacheManager:
    """Which blocks each request holds. `allocate_slots` returns new blocks or None; the
    scheduler decides what None means (preempt, or do not admit)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        pool: BlockPool | None = None,
        group: int = 0,
    ) -> None:
        """sliding_window: every layer's window, when all layers have the same one (blocks
        before it are freed); None keeps every block of a request until it ends. pool, group:
        this manager is KV group `group` of a hybrid model, drawing from a shared pool
        (kv_hybrid.py)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.group = group
        self.pool = pool if pool is not None else BlockPool(num_blocks, enable_caching)
        # a freed window block is None here and NULL_BLOCK_ID in the ids
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._num_skipped: dict[str, int] = {}  # leading blocks freed behind the window
        self.num_window_freed_blocks = 0  # total, since start

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks. At least one token is always left to compute,
        since the last position's logits are needed to sample."""
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash, self.group)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def take_tier_hits(self, request: Request, num_pool_hits: int) -> list[int]:
        """The hashes continuing the pool's hits that the tiers below it hold (kv_tier.py),
        taken out of the tier index: allocate blocks for them, then `tier.restore` them into
        those blocks (or `tier.put_back` them). At least one token is left to compute."""
        tier = self.pool.tier
        if tier is None or not self.enable_caching or not len(tier):
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        return tier.take(request.block_hashes[num_pool_hits:max_hit_blocks])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after the
        prefix-cache hits in `new_computed_blocks`). Returns the newly allocated blocks, or None
        when the pool cannot supply them (nothing is changed then)."""
        plan = self.plan(request, num_new_tokens, new_computed_blocks)
        if plan is None:
            return []
        num_new, num_evictable_hits = plan
        # hits on free blocks come off the free list, so they count against what is free
        if num_new > self.pool.num_free_blocks - num_evictable_hits:
            return None
        return self.commit(request, num_new_tokens, new_computed_blocks, num_new)

    def plan(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock | None] | None,
    ) -> tuple[int, int] | None:
        """Frees the blocks behind the window, then: None when the held blocks have room and
        none fills up (most decode steps), else (new blocks needed, hits now on the free list).
        A hit of None is a position behind the window (a hybrid group's, kv_hybrid.py)."""
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        if held and self.sliding_window is not None:
            self._free_skipped(request, held)
        if held and not new_computed_blocks:
            total_tokens = request.num_computed_tokens + num_new_tokens
            if total_tokens <= len(held) * self.block_size and (
                not self.enable_caching
                or total_tokens // self.block_size <= self._num_cached_blocks[rid]
            ):
                return None
        computed = new_computed_blocks or []
        num_held = len(held) if held else 0
        total_tokens = (
            request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        )
        num_new = self.blocks_needed(total_tokens) - num_held - len(computed)
        return num_new, sum(1 for b in computed if b is not None and b.ref_cnt == 0)

    def commit(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock | None] | None,
        num_new: int,
        touched: bool = False,
    ) -> list[KVBlock]:
        """Take the hits and `num_new` new blocks (`plan`'s count, known to be free).
        touched: the hits' references are taken already (kv_hybrid.py takes every group's
        before any group's new blocks, which could otherwise evict another group's hit)."""
        rid = request.request_id
        held = self.req_to_blocks.get(rid)
        computed = new_computed_blocks or []
        total_tokens = (
            request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        )
        if held is None:
            held = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
            self._num_cached_blocks[rid] = 0
        ids = self.req_to_block_ids[rid]
        if computed:
            if computed[0] is None:  # a hybrid group's hit starts behind its window
                skipped = next((i for i, b in enumerate(computed) if b is not None), len(computed))
                self._num_skipped[rid] = len(held) + skipped
            if not touched:
                self.pool.touch(b for b in computed if b is not None)
            held.extend(computed)
            ids.extend(NULL_BLOCK_ID if b is None else b.block_id for b in computed)
            self._num_cached_blocks[rid] = len(held)
        new_blocks = self.pool.get_new_blocks(num_new) if num_new > 0 else []
        held.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, held, total_tokens)
        return new_blocks

    def _free_skipped(self, request: Request, held: list[KVBlock | None]) -> None:
        """Free the blocks wholly before the window of the request's next query (at position
        num_computed_tokens: it sees keys from num_computed_tokens - window + 1 on)."""
        rid = request.request_id
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        end = min(max(0, first_needed) // self.block_size, len(held))
        done = self._num_skipped.get(rid, 0)
        if end <= done:
            return
        ids = self.req_to_block_ids[rid]
        freed = held[done:end]
        for i in range(done, end):
            held[i] = None
            ids[i] = NULL_BLOCK_ID
        self._num_skipped[rid] = end
        self.num_window_freed_blocks += sum(b is not None for b in freed)
        # later blocks first: the free list's tail is evicted last, and a prompt's early blocks
        # are the likeliest prefix hits
        self.pool.free_blocks(b for b in reversed(freed) if b is not None)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (freed window blocks not counted)."""
        return sum(b is not None for b in self.req_to_blocks.get(request_id, ()))

    def _cache_full_blocks(
        self, request: Request, held: list[KVBlock | None], total_tokens: int
    ) -> None:
        rid = request.request_id
        start = self._num_cached_blocks[rid]
        end = min(total_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        hashes = request.block_hashes
        for i in range(start, end):
            if held[i] is not None:  # freed behind the window: cached when it was computed
                parent = hashes[i - 1] if i else request.block_root
                self.pool.cache_block(held[i], hashes[i], parent, self.group)
        self._num_cached_blocks[rid] = end

    def _in_flight_blocks(self, request: Request, num_computed: int) -> list[KVBlock]:
        """The request's blocks cached at allocation whose tokens are not all computed before
        this step (`num_computed`: its computed tokens when the step began)."""
        held = self.req_to_blocks.get(request.request_id) or []
        cached = self._num_cached_blocks.get(request.request_id, 0)
        return [b for b in held[num_computed // self.block_size : cached] if b is not None]

    def in_flight_shared(self, request: Request, num_computed: int) -> bool:
        """Whether another request holds one of this request's blocks that are cached but
        only being computed in this step (a same-step prefix hit on them)."""
        return any(b.ref_cnt > 1 for b in self._in_flight_blocks(request, num_computed))

    def uncache_in_flight(self, request: Request, num_computed: int) -> None:
        """A request scheduled and then preempted in the same step: the blocks its allocation
        cached were never computed, so they must not be found by a later lookup (its own
        resumption included)."""
        blocks = self._in_flight_blocks(request, num_computed)
        for block in blocks:
            self.pool.uncache_block(block)
        if blocks:
            self._num_cached_blocks[request.request_id] = num_computed // self.block_size

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first: the end of a sequence is the least
        likely to be shared, so it is evicted first."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        self._num_skipped.pop(rid, None)
        if blocks:
            self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_to_block_ids.get(request_id, [])

    def holders(self) -> dict[int, int]:
        """Block id -> how many of this manager's tables hold it (asserting ids match blocks)."""
        holders: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            ids = self.req_to_block_ids[rid]
            assert len(ids) == len(blocks), f"{rid}: block ids drifted from its blocks"
            for b, block_id in zip(blocks, ids):
                if b is None:  # freed behind the window
                    assert block_id == NULL_BLOCK_ID, f"{rid}: a freed block left id {block_id}"
                    continue
                assert b.block_id == block_id, f"{rid}: id {block_id} for {b}"
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        return holders

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (used by tests after every step)."""
        check_pool(self.pool, self.holders())


def check_pool(pool: BlockPool, holders: dict[int, int]) -> None:
    """Assert the pool's books agree with `holders` (block id -> tables holding it)."""
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == pool.num_free_blocks, "free count drifted from the free list"
    assert len(set(free_ids)) == len(free_ids), "a block is on the free list twice"
    in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert pool.num_free_blocks + in_use == pool.num_blocks, "free + in use != total"
    for b in pool.blocks:
        assert b.ref_cnt == holders.get(b.block_id, 0), f"{b} ref_cnt != holders"
        assert (b.ref_cnt == 0) == (b.prev_free is not None), f"{b} free-list membership"
    for h, b in pool.cached.items():
        assert b.block_hash == h, f"cache entry {h} points at {b}"
