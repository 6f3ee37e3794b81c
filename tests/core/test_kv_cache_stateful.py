"""Stateful property test of the KV cache manager and block pool: random admissions (with prefix hits),
prefill chunks, decodes and frees, checking after every operation that reference counts, the free list
and the hash map agree, and that every prefix hit holds exactly the tokens of the request that hits it."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.config import CacheConfig
from pagedllm.core.hashing import get_request_block_hasher
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 2
NUM_BLOCKS = 12
MAX_LEN = 24
HASHER = get_request_block_hasher(CacheConfig(block_size=BS))
PARAMS = SamplingParams(max_tokens=None)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, MAX_LEN)
        self.live: dict[str, Request] = {}
        # block id -> the tokens its slots hold (written by the request that computed them).
        self.content: dict[int, list[int | None]] = {}
        self.next_id = 0

    def _write(self, r: Request, start: int, end: int) -> None:
        blocks = self.kv.req_to_blocks[r.request_id]
        for pos in range(start, end):
            slots = self.content.setdefault(blocks[pos // BS].block_id, [None] * BS)
            slots[pos % BS] = r.all_token_ids[pos]

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=MAX_LEN - 1), chunk=st.integers(1, 8))
    def admit(self, prompt: list[int], chunk: int) -> None:
        r = Request(str(self.next_id), prompt, PARAMS, None, block_hasher=HASHER)
        self.next_id += 1
        hits, num_hit = self.kv.get_computed_blocks(r)
        assert num_hit < r.num_tokens and num_hit == len(hits) * BS
        for i, block in enumerate(hits):  # a hit holds exactly this request's tokens
            assert self.content[block.block_id] == prompt[i * BS : (i + 1) * BS]
        n = min(chunk, r.num_tokens - num_hit)
        if self.kv.allocate_slots(r, n, num_hit, hits) is None:
            assert r.request_id not in self.kv.req_to_blocks
            return
        r.num_computed_tokens = num_hit
        self._write(r, num_hit, num_hit + n)
        r.num_computed_tokens += n
        self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 2))
    def advance(self, data: st.DataObject, chunk: int, token: int) -> None:
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if r.num_computed_tokens == r.num_tokens:  # decode: the token sampled last step
            if r.num_tokens >= MAX_LEN:
                return
            r.append_output_token_ids(token)
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        if self.kv.allocate_slots(r, n) is None:
            return
        self._write(r, r.num_computed_tokens, r.num_computed_tokens + n)
        r.num_computed_tokens += n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(r)

    @invariant()
    def consistent(self) -> None:
        pool = self.kv.block_pool
        holders: dict[int, int] = {}
        for blocks in self.kv.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks)
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert set(self.kv.req_to_blocks) == set(self.live)
        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == pool.get_num_free_blocks()
        for b in pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0)
            assert (b in free) == (b.ref_cnt == 0)
            if b.block_hash is not None:
                assert pool.cached_block_hash_to_block[b.block_hash] is b
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h
        # Every live request's blocks cover its computed tokens and hold them.
        for r in self.live.values():
            blocks = self.kv.req_to_blocks[r.request_id]
            assert len(blocks) * BS >= r.num_computed_tokens
            for pos in range(r.num_computed_tokens):
                assert self.content[blocks[pos // BS].block_id][pos % BS] == r.all_token_ids[pos]

    def teardown(self) -> None:
        for r in self.live.values():
            self.kv.free(r)
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)
        assert self.kv.usage == 0.0 and self.kv.reset_prefix_cache()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
