"""KV cache events from the block pool (no model, no sockets): what a router rebuilds from the events
equals the pool's prefix cache after every operation, and the events decode with vLLM's types."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from pagedllm.config import CacheConfig
from pagedllm.core.hashing import BlockHash, get_hash_function, get_request_block_hasher, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import MEDIUM_DISK, KVEventBatch, KVEventRecorder, external_block_hash
from pagedllm.core.request import Request
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import kv_event_subscriber as vllm_sub  # noqa: E402

BS = 4
HASHER = get_request_block_hasher(CacheConfig(block_size=BS))


def req(req_id: str, tokens: list[int], lora_int_id: int = 0) -> Request:
    lora = LoRARequest(f"lora{lora_int_id}", lora_int_id, "/adapters") if lora_int_id else None
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, lora_request=lora, block_hasher=HASHER)


def admit(kv: KVCacheManager, r: Request) -> bool:
    blocks, hit = kv.get_computed_blocks(r)
    if kv.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
        return False
    r.num_computed_tokens = r.num_tokens
    return True


class Router:
    """The subscriber side: every batch goes over msgpack and is decoded with vLLM's types."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.batches: list[vllm_sub.KVEventBatch] = []
        self.full_hashes: dict[int, BlockHash] = {}

    def sync(self, *requests: Request) -> None:
        for r in requests:
            self.full_hashes.update((external_block_hash(h), h) for h in r.block_hashes)
        wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=self.kv.take_events(), data_parallel_rank=0))
        self.batches.append(vllm_sub.DECODER.decode(wire))
        expected = {external_block_hash(h) for h in self.kv.block_pool.cached_block_hash_to_block}
        assert vllm_sub.cached_hashes(self.batches) == expected

    def check_stored_contents(self) -> None:
        """Each stored block's hash is the hash of its tokens chained to its parent."""
        hash_fn = get_hash_function("sha256")
        for batch in self.batches:
            for event in batch.events:
                if not isinstance(event, vllm_sub.BlockStored):
                    continue
                assert event.medium == "GPU" and event.block_size == BS
                assert len(event.token_ids) == BS * len(event.block_hashes)
                parent = None if event.parent_block_hash is None else self.full_hashes[event.parent_block_hash]
                for i, ext in enumerate(event.block_hashes):
                    extra = event.extra_keys[i] if event.extra_keys else None
                    block = hash_block_tokens(hash_fn, parent, event.token_ids[i * BS : (i + 1) * BS], extra)
                    assert external_block_hash(block) == ext
                    parent = block


def test_events_track_the_prefix_cache_through_hits_evictions_and_reset() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=32, enable_kv_cache_events=True)
    router = Router(kv)
    rng = random.Random(0)
    prefixes = [[rng.randrange(50) for _ in range(2 * BS)] for _ in range(3)]
    live: list[Request] = []
    for i in range(40):
        if live and (len(live) > 2 or rng.random() < 0.4):
            kv.free(live.pop(rng.randrange(len(live))))
            router.sync()
            continue
        tail = [rng.randrange(50) for _ in range(rng.randrange(1, 3 * BS))]
        r = req(f"r{i}", rng.choice(prefixes) + tail, lora_int_id=rng.choice([0, 0, 7]))
        if admit(kv, r):
            live.append(r)
        router.sync(r)
    events = [e for b in router.batches for e in b.events]
    assert any(isinstance(e, vllm_sub.BlockRemoved) for e in events), "the pool never evicted"
    assert any(isinstance(e, vllm_sub.BlockStored) and e.lora_id == 7 for e in events)
    router.check_stored_contents()

    last = req("last", prefixes[0] + [1])
    assert admit(kv, last)
    live.append(last)
    router.sync(last)
    assert not kv.reset_prefix_cache()  # blocks in use: nothing happens, nothing is announced
    router.sync()
    for r in live:
        kv.free(r)
    assert kv.reset_prefix_cache()
    router.sync()
    assert isinstance(router.batches[-1].events[-1], vllm_sub.AllBlocksCleared)


def test_a_duplicate_block_is_not_announced_and_withdrawn_blocks_are_removed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=32, enable_kv_cache_events=True)
    router = Router(kv)
    prompt = list(range(3 * BS + 1))
    a, b = req("a", prompt), req("b", prompt)
    blocks_b, hit_b = kv.get_computed_blocks(b)  # looked up before a registered anything: no hit
    assert admit(kv, a)
    kv.allocate_slots(b, b.num_tokens, hit_b, blocks_b)
    router.sync(a, b)
    stored = [e for e in router.batches[-1].events if isinstance(e, vllm_sub.BlockStored)]
    assert len(stored) == 1 and stored[0].parent_block_hash is None and stored[0].token_ids == prompt[: 3 * BS]

    # A request whose step is undone before it ran withdraws the blocks it registered.
    c = req("c", list(range(100, 100 + 2 * BS + 1)))
    admit(kv, c)
    c.num_computed_tokens = 0
    kv.uncache_unscheduled_blocks(c)
    router.sync(c)
    assert isinstance(router.batches[-1].events[-1], vllm_sub.BlockRemoved)


@pytest.mark.parametrize("caching", [True, False])
def test_no_events_unless_enabled_with_prefix_caching(caching: bool) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=16, enable_caching=caching)
    admit(kv, req("a", list(range(9))))
    assert kv.kv_events is None and kv.take_events() == []
    if not caching:
        on = KVCacheManager(8, BS, 16, enable_caching=False, enable_kv_cache_events=True)
        assert on.kv_events is None


def test_a_second_tier_records_its_own_medium() -> None:
    recorder = KVEventRecorder(block_size=BS)
    h = [bytes([i]) * 32 for i in range(3)]
    recorder.record_stored(h[1:], h[0], list(range(2 * BS)), medium=MEDIUM_DISK)
    recorder.record_removed(h[1:2], medium=MEDIUM_DISK)
    batch = vllm_sub.DECODER.decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=recorder.take_events())))
    assert vllm_sub.cached_hashes([batch], medium="DISK") == {external_block_hash(h[2])}
    assert vllm_sub.cached_hashes([batch]) == set()
    assert batch.events[0].parent_block_hash == int.from_bytes(h[0][-8:], "big")
    assert recorder.take_events() == []


def test_core_records_events_without_sockets() -> None:
    """Publishing (zmq) belongs to the engine: core/ only records."""
    code = (
        "import sys\n"
        "import pagedllm.core.kv_events, pagedllm.core.block_pool, pagedllm.core.scheduler\n"
        "print('zmq' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
