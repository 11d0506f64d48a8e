"""Unit tests of the KV-cache bookkeeping: FreeBlockQueue order and O(1) removal, BlockPool ref
counts, eviction and prefix-cache table, KVCacheManager allocation and freeing."""

from __future__ import annotations

import time

import pytest

from replica.kv_cache import BlockPool, FreeBlockQueue, KVBlock, KVCacheManager
from replica.request import Request, SamplingParams
from tests.helpers import scheduler_request


def make_blocks(n: int) -> list[KVBlock]:
    return [KVBlock(i) for i in range(n)]


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def make_request(rid: str, tokens: list[int], block_size: int) -> Request:
    request = scheduler_request(rid, tokens, SamplingParams(max_tokens=8))
    request.update_block_hashes(block_size)
    return request


def append_token(request: Request, token: int) -> None:
    """A sampled token, as Scheduler.update_from_output appends it (block size 4)."""
    request.all_token_ids.append(token)
    request.update_block_hashes(4)


# -- FreeBlockQueue ---------------------------------------------------------------------------
def test_free_queue_keeps_insertion_order_and_pops_from_the_head():
    blocks = make_blocks(4)
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3]
    assert queue.num_free == 4
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert [b.block_id for b in queue] == [2, 3]
    assert queue.num_free == 2


def test_free_queue_remove_from_the_middle_relinks_neighbours_and_clears_links():
    blocks = make_blocks(5)
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert queue.num_free == 4


def test_free_queue_remove_head_and_tail():
    blocks = make_blocks(3)
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [1]
    assert queue.popleft() is blocks[1]
    assert list(queue) == []
    assert queue.num_free == 0


def test_free_queue_append_goes_to_the_tail_after_a_remove():
    blocks = make_blocks(4)
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[1])
    queue.append(blocks[1])
    assert [b.block_id for b in queue] == [0, 2, 3, 1]
    assert queue.num_free == 4


def test_free_queue_popleft_on_empty_queue_raises():
    queue = FreeBlockQueue([])
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    assert queue.num_free == 0


def test_free_queue_remove_does_not_walk_the_list():
    # O(n) removal would walk ~100k links per call: 2,000 calls would take many seconds.
    blocks = make_blocks(200_000)
    queue = FreeBlockQueue(blocks)
    middle = blocks[50_000:52_000]
    began = time.perf_counter()
    for block in middle:
        queue.remove(block)
    elapsed = time.perf_counter() - began
    assert queue.num_free == 198_000
    assert blocks[49_999].next_free is blocks[52_000]
    assert elapsed < 0.5, f"2,000 removals took {elapsed:.3f}s"


# -- BlockPool ---------------------------------------------------------------------------------
def test_pool_rejects_an_empty_pool_naming_the_size():
    with pytest.raises(ValueError, match="at least 1 block, got 0"):
        BlockPool(0)


def test_pool_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(0.75)


def test_pool_refuses_more_blocks_than_are_free_naming_both_numbers():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="asked for 3 blocks, only 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_pool_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [4, 1, 0, 3, 2]


def test_pool_block_with_two_references_stays_in_use_after_one_free():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [1]
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 0]


def test_pool_double_free_is_caught():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_pool_touch_on_a_free_cached_block_takes_it_off_the_free_list():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 1234)
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 2, 0]
    hit = pool.get_cached_block(1234)
    assert hit is block
    pool.touch([hit])
    assert free_ids(pool) == [1, 2]
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2


def test_pool_freed_block_keeps_its_hash_until_reused():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 99)
    pool.free_blocks([block])
    assert block.block_hash == 99
    assert pool.get_cached_block(99) is block
    (again,) = pool.get_new_blocks(1)
    assert again is block
    assert block.block_hash is None
    assert pool.get_cached_block(99) is None


def test_pool_first_cached_block_for_a_hash_stays_canonical():
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, 7)
    pool.cache_block(second, 7)
    assert pool.get_cached_block(7) is first
    # evicting the duplicate must not drop the canonical entry
    pool.free_blocks([second])
    pool.get_new_blocks(2)  # block 2, then the duplicate (block 1)
    assert second.block_hash is None
    assert pool.get_cached_block(7) is first


def test_pool_cache_block_is_a_no_op_without_prefix_caching():
    pool = BlockPool(1, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 5)
    assert block.block_hash is None
    assert pool.get_cached_block(5) is None


# -- KVCacheManager ----------------------------------------------------------------------------
def test_manager_allocates_exactly_the_blocks_the_tokens_need():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(9)), 4)
    new = kv.allocate_slots(request, 9)
    assert [b.block_id for b in new] == [0, 1, 2]
    request.num_computed_tokens = 9
    assert kv.allocate_slots(request, 3) == []  # 12 tokens still fit in 3 blocks
    request.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate_slots(request, 1)] == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.check_invariants()


def test_manager_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)), 4)
    kv.allocate_slots(a, 8)
    b = make_request("b", list(range(100, 109)), 4)
    assert kv.allocate_slots(b, 9) is None
    assert kv.pool.num_free_blocks == 1
    assert kv.block_ids("b") == []
    assert "b" not in kv.req_to_blocks
    kv.check_invariants()


def test_manager_caches_only_full_blocks_of_scheduled_tokens():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", list(range(10)), 4)
    kv.allocate_slots(request, 6)  # a chunk: only block 0 is full
    assert [b.block_hash for b in kv.req_to_blocks["a"]] == [request.block_hashes[0], None]
    request.num_computed_tokens = 6
    kv.allocate_slots(request, 4)
    blocks = kv.req_to_blocks["a"]
    assert [b.block_hash for b in blocks] == [*request.block_hashes, None]
    assert kv.pool.get_cached_block(request.block_hashes[1]) is blocks[1]


def test_manager_decode_step_that_fills_a_block_caches_it():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", [1, 2, 3], 4)
    assert len(kv.allocate_slots(request, 3)) == 1
    request.num_computed_tokens = 3
    append_token(request, 4)  # 4 tokens: block 0's hash is now known
    assert kv.allocate_slots(request, 1) == []
    (block,) = kv.req_to_blocks["a"]
    assert block.block_hash == request.block_hashes[0]
    assert kv.pool.get_cached_block(request.block_hashes[0]) is block
    request.num_computed_tokens = 4
    append_token(request, 5)
    assert [b.block_id for b in kv.allocate_slots(request, 1)] == [1]
    kv.check_invariants()


def test_manager_prefix_hit_is_the_longest_cached_chain_capped_below_num_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(12)), 4)
    kv.allocate_slots(a, 12)
    same = make_request("same", list(range(12)), 4)
    hits, num_hit_tokens = kv.get_computed_blocks(same)
    # all 3 blocks are cached, but the last token must be computed to sample: 2 blocks
    assert [b.block_id for b in hits] == [0, 1]
    assert num_hit_tokens == 8
    diverging = make_request("div", [*range(4), 99, *range(5, 13)], 4)
    hits, num_hit_tokens = kv.get_computed_blocks(diverging)
    assert [b.block_id for b in hits] == [0]
    assert num_hit_tokens == 4


def test_manager_reports_no_hits_without_prefix_caching():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request("a", list(range(12)), 4)
    kv.allocate_slots(a, 12)
    assert all(b.block_hash is None for b in kv.req_to_blocks["a"])
    assert kv.get_computed_blocks(make_request("b", list(range(12)), 4)) == ([], 0)


def test_manager_hits_on_free_blocks_count_against_the_free_pool():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)), 4)
    kv.allocate_slots(a, 8)
    kv.free(a)  # both blocks free, still cached
    b = make_request("b", [*range(8), 50, 51, 52, 53, 54], 4)
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 8
    # 13 tokens = 4 blocks: 2 hits + 2 new, but only 1 block is free besides the hits
    assert kv.allocate_slots(b, 5, hits) is None
    assert kv.pool.num_free_blocks == 3
    c = make_request("c", [*range(8), 50, 51], 4)
    hits, _ = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, 2, hits)
    assert [b.block_id for b in new] == [2]
    assert kv.block_ids("c") == [0, 1, 2]
    assert kv.pool.num_free_blocks == 0
    kv.check_invariants()


def test_manager_free_releases_blocks_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", list(range(6)), 2)
    kv.allocate_slots(a, 6)  # blocks 0, 1, 2
    kv.free(a)
    assert free_ids(kv.pool) == [3, 4, 5, 2, 1, 0]
    assert kv.block_ids("a") == []
    kv.check_invariants()


def test_manager_shared_block_is_freed_only_by_its_last_holder():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", [*range(4), 9], 4)
    kv.allocate_slots(a, 5)
    b = make_request("b", [*range(4), 8], 4)
    hits, _ = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 1, hits)
    shared = kv.req_to_blocks["a"][0]
    assert shared is kv.req_to_blocks["b"][0]
    assert shared.ref_cnt == 2
    kv.free(a)
    assert shared.ref_cnt == 1
    assert shared.block_id not in free_ids(kv.pool)
    kv.check_invariants()
    kv.free(b)
    assert shared.ref_cnt == 0
    kv.check_invariants()


def test_check_invariants_catches_a_ref_count_that_disagrees_with_holders():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(3)), 4)
    kv.allocate_slots(a, 3)
    kv.req_to_blocks["a"][0].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref_cnt != holders"):
        kv.check_invariants()


def test_check_invariants_catches_a_held_block_left_on_the_free_list():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(3)), 4)
    kv.allocate_slots(a, 3)
    kv.pool.free_queue.append(kv.req_to_blocks["a"][0])
    with pytest.raises(AssertionError):
        kv.check_invariants()
