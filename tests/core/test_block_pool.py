"""The block pool: free list order (LRU eviction), O(1) removal, ref counts, the hash map."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_remove_append_popleft_n() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])  # from the middle
    q.remove(blocks[0])  # the head
    q.remove(blocks[4])  # the tail
    assert ids(q.get_all_free_blocks()) == [1, 3] and q.num_free_blocks == 2
    q.append(blocks[0])
    q.append(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 3, 0, 4]
    assert ids(q.popleft_n(3)) == [1, 3, 0]
    assert ids(q.get_all_free_blocks()) == [4] and q.num_free_blocks == 1
    assert ids(q.popleft_n(1)) == [4] and q.get_all_free_blocks() == [] and q.num_free_blocks == 0
    with pytest.raises(ValueError, match="only 0 free"):
        q.popleft_n(1)
    with pytest.raises(ValueError, match="not in the free list"):
        q.remove(blocks[1])
    q.append(blocks[1])
    assert ids(q.get_all_free_blocks()) == [1]


def test_lru_eviction_order_and_hash_map() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    pool.cache_full_blocks(a, [b"h0", b"h1"], 0, 2)
    assert pool.get_cached_block(b"h0") is a[0] and a[2].block_hash is None
    # Freed tail first: the end of the sequence will be evicted before its prefix.
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1, 0]
    assert pool.get_usage() == 0.0
    # Never-used blocks go first, then a's tail; cached content survives until its block is reused.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    assert pool.get_cached_block(b"h1") is a[1]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(b"h1") is None and a[1].block_hash is None  # evicted
    assert pool.get_cached_block(b"h0") is a[0]


def test_touch_takes_cached_blocks_out_of_the_free_list() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"x", b"y"], 0, 2)
    pool.free_blocks(reversed(a))
    pool.touch([a[0]])  # a hit by a second request
    assert a[0].ref_cnt == 1 and pool.get_num_free_blocks() == 3
    assert a[0] not in pool.free_block_queue.get_all_free_blocks()
    pool.touch([a[0]])  # a third user: no list change
    assert a[0].ref_cnt == 2 and pool.get_num_free_blocks() == 3
    pool.free_blocks([a[0]])
    assert a[0].ref_cnt == 1 and pool.get_num_free_blocks() == 3
    pool.free_blocks([a[0]])
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a[0]])


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [b"same"], 0, 1)
    pool.cache_full_blocks(b, [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a[0] and b[0].block_hash is None
    # Evicting the uncached duplicate leaves the entry alone.
    pool.free_blocks(b)
    pool.free_blocks(a)
    assert ids(pool.get_new_blocks(3)) == [2, 3, 1]
    assert pool.get_cached_block(b"same") is a[0]


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"p", b"q"], 0, 2)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"p") is a[0]
    pool.free_blocks(a)
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in pool.blocks)


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
