"""The KV cache manager: prefix hits, slot allocation, freeing, statistics."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig
from pagedllm.core.hashing import get_request_block_hasher
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def req(req_id: str, tokens: list[int], **params: object) -> Request:
    hasher = get_request_block_hasher(CacheConfig(block_size=BS))
    return Request(req_id, tokens, SamplingParams(max_tokens=4, **params), None, block_hasher=hasher)  # type: ignore[arg-type]


def admit(kv: KVCacheManager, r: Request) -> int:
    """Allocate a whole prompt the way the scheduler admits a request; returns the hit length."""
    blocks, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    return hit


def test_shared_prefix_hits_full_blocks_only() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64)
    prefix = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = req("a", prefix + [1])
    assert admit(kv, a) == 0
    b = req("b", prefix + [2, 3])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8 and blocks == kv.req_to_blocks["a"][:2]
    kv.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    # Shared blocks count both users; the partial third block is b's own.
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [2, 2, 1]
    assert kv.req_to_blocks["b"][2] is not kv.req_to_blocks["a"][2]


def test_whole_prompt_is_never_a_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64)
    admit(kv, req("a", list(range(8))))
    # Same 8 tokens: both blocks are cached, but the last token must be recomputed for its logits.
    assert kv.get_computed_blocks(req("b", list(range(8))))[1] == 4
    assert kv.get_computed_blocks(req("c", list(range(9))))[1] == 8


def test_prompt_logprobs_and_disabled_caching_get_no_hits() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64)
    admit(kv, req("a", list(range(12))))
    assert kv.get_computed_blocks(req("b", list(range(12)), prompt_logprobs=1)) == ([], 0)
    off = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=64, enable_caching=False)
    admit(off, req("a", list(range(12))))
    assert off.block_pool.cached_block_hash_to_block == {}
    assert off.get_computed_blocks(req("b", list(range(12)))) == ([], 0)


def test_allocation_grows_by_blocks_and_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=16, enable_caching=False)
    a = req("a", list(range(5)))
    assert len(kv.allocate_slots(a, 5) or []) == 2
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 3) == []  # still within the second block
    b = req("b", list(range(9)))
    assert kv.allocate_slots(b, 9) is None  # needs 3, 2 free
    assert "b" not in kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == 2
    assert len(kv.allocate_slots(b, 8) or []) == 2
    assert kv.usage == 1.0
    with pytest.raises(ValueError, match="num_new_tokens > 0"):
        kv.allocate_slots(a, 0)


def test_lookahead_and_max_model_len_cap() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=10)
    a = req("a", list(range(3)))
    assert len(kv.allocate_slots(a, 3, num_lookahead_tokens=2) or []) == 2
    b = req("b", list(range(9)))
    # 9 + 4 lookahead slots would be 4 blocks; max_model_len=10 caps it at 3.
    assert len(kv.allocate_slots(b, 9, num_lookahead_tokens=4) or []) == 3


def test_evictable_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=32)
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # 3 blocks cached and free, 1 never used
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54, 55, 56])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    # 2 hits (taken from the free list) + 2 new blocks = all 4: fits; 4 new (lookahead) would not.
    assert kv.allocate_slots(b, 11, hit, blocks, num_lookahead_tokens=4) is None
    assert kv.block_pool.get_num_free_blocks() == 4 and blocks[0].ref_cnt == 0
    new = kv.allocate_slots(b, 7, hit, blocks)
    assert new is not None and len(new) == 2 and kv.usage == 1.0


def test_free_returns_blocks_tail_first_and_ref_counts_to_zero() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=32)
    a, b = req("a", list(range(10))), req("b", list(range(10)) + [7])
    admit(kv, a)
    admit(kv, b)
    a_ids = kv.get_block_ids("a")
    b_ids = kv.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2]
    kv.free(a)
    # a's private tail block is free; the shared ones are still held by b.
    assert [blk.block_id for blk in kv.block_pool.free_block_queue.get_all_free_blocks()][-1] == a_ids[2]
    kv.free(b)
    free_ids = [blk.block_id for blk in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids[-3:] == [b_ids[2], b_ids[1], b_ids[0]]
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks) and kv.usage == 0.0
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}
    kv.free(b)  # freeing twice is harmless
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("c", list(range(10))))[1] == 0


def test_output_blocks_are_cached_as_they_fill() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=32)
    a = req("a", [1, 2, 3])
    admit(kv, a)
    for t in (4, 5, 6):  # decode: the sampled token is computed in the next step
        a.append_output_token_ids(t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert kv.num_cached_blocks["a"] == 1
    # A follow-up prompt that continues the conversation hits the block holding the output.
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5, 6, 9]))[1] == 4


def test_prefix_cache_counters() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=32)
    kv.record_prefix_cache_lookup(12, 8)
    kv.record_prefix_cache_lookup(5, 0)
    assert kv.take_prefix_cache_stats() == (17, 8)
    assert kv.take_prefix_cache_stats() == (0, 0)
    off = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=32, enable_caching=False)
    off.record_prefix_cache_lookup(12, 0)
    assert off.take_prefix_cache_stats() == (0, 0)


def test_uncache_unscheduled_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=32)
    a = req("a", list(range(14)))
    kv.allocate_slots(a, 6)  # registers block 0 (tokens 0-3)
    a.num_computed_tokens = 6
    kv.allocate_slots(a, 7)  # this step would fill blocks 1 and 2
    assert kv.num_cached_blocks["a"] == 3
    kv.uncache_unscheduled_blocks(a)  # ... but it is undone before it runs
    table = kv.block_pool.cached_block_hash_to_block
    assert a.block_hashes[0] in table and a.block_hashes[1] not in table and a.block_hashes[2] not in table
    assert kv.num_cached_blocks["a"] == 1
    kv.free(a)
    assert kv.get_computed_blocks(req("b", list(range(14))))[1] == 4
