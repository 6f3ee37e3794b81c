"""The pool of KV cache blocks: reference counts, the free list, and the prefix cache's hash map.

A block with ref_cnt == 0 sits in the free list but keeps its KV content and its hash, so a later request
with the same prefix can take it back ("touch") instead of recomputing it. The free list is ordered for
eviction: blocks are taken for new allocations from the head (least recently freed first), and a freed
request's blocks are appended tail-block-first, so the ends of sequences are evicted before the shared
beginnings. Touching a cached block removes it from the middle of the list, hence a doubly linked list
(O(1) removal) rather than a deque.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pagedllm.core.hashing import BlockHash, request_extra_keys
from pagedllm.core.kv_events import KVEventRecorder

if TYPE_CHECKING:
    from pagedllm.core.request import Request


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and registered in the prefix cache; cleared on eviction.
        self.block_hash: BlockHash | None = None
        # Links of the free list (None while the block is in use).
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"
        )


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks between two sentinels (no None checks at the ends)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"{n} KV cache blocks requested, only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free list")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head (next to be evicted) to tail; for tests and debugging."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    def __init__(self, num_blocks: int, kv_events: KVEventRecorder | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash. Two requests that compute the same block at the same time (neither hit
        # the other) leave the second copy uncached; it is freed like any other block.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Records blocks entering and leaving the hash map (None: KV cache events are off).
        self.kv_events = kv_events
        # Called with each cached block evicted for reuse, before its hash is cleared and before its KV
        # is overwritten (a KV connector's offloading tier keeps a copy).
        self.evicted_block_listeners: list[Callable[[KVCacheBlock], None]] = []

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        request: Request | None = None,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of one request under their hashes (the
        request's tokens go into the KV cache events)."""
        table = self.cached_block_hash_to_block
        stored: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix-cache hit: already registered
            block_hash = block_hashes[i]
            if block_hash in table:
                continue
            block.block_hash = block_hash
            table[block_hash] = block
            stored.append(i)
        if self.kv_events is not None and stored and request is not None:
            self._record_stored(stored, block_hashes, request)

    def _record_stored(self, stored: list[int], block_hashes: list[BlockHash], request: Request) -> None:
        """One BlockStored per run of consecutive registered blocks (a block another request had
        registered first splits the run: it is not this request's to announce)."""
        assert self.kv_events is not None
        block_size = self.kv_events.block_size
        extra_keys = request_extra_keys(request)
        lora_id = request.lora_int_id or None
        start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[start], stored[k - 1]
            self.kv_events.record_stored(
                block_hashes[first : last + 1],
                block_hashes[first - 1] if first > 0 else None,
                request.all_token_ids[first * block_size : (last + 1) * block_size],
                extra_keys,
                lora_id,
            )
            start = k

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free list (evicting their cached content)."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        removed: list[BlockHash] = []
        for block in blocks:
            if block.block_hash is not None:
                for listener in self.evicted_block_listeners:
                    listener(block)
                self._evict(block, removed)
            block.ref_cnt = 1
        if removed and self.kv_events is not None:
            self.kv_events.record_removed(removed)
        return blocks

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Withdraw blocks from the prefix cache (their KV will not be written after all)."""
        removed: list[BlockHash] = []
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block, removed)
        if removed and self.kv_events is not None:
            self.kv_events.record_removed(removed)

    def _evict(self, block: KVCacheBlock, removed: list[BlockHash]) -> None:
        """Forget the block's hash, appending it to `removed` if it left the hash map."""
        assert block.block_hash is not None
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            removed.append(block.block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit sitting in the free list leaves it."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks reaching zero join the free list's tail in the given
        order (the first of them will be evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use (a running request's
        blocks would otherwise stay registered under stale hashes). Returns whether it was reset."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.record_all_cleared()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
