"""A KV cache event subscriber written the way one for vLLM is: its own msgspec types, copied from
vLLM's `vllm/distributed/kv_events.py` (and its examples/features/kv_events/kv_events_subscriber.py),
not pagedllm's, so the tests prove that a vLLM subscriber reads pagedllm's stream."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int


# -- vLLM's wire types: the batch is a positional array, each event a map tagged by "type" ----------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# forbid_unknown_fields would reject additions; a strict decoder still rejects wrong types or shapes.
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """SUB socket on the event stream, and a DEALER socket on the replay endpoint if given (the replay
    streams many replies to one request, which a REQ socket would drop after the first)."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.topic = topic.encode()
        self.replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.connect(replay_endpoint)

    def receive(self, idle_timeout_s: float = 1.0) -> list[tuple[int, KVEventBatch]]:
        """Every message until none arrives for `idle_timeout_s`: (sequence number, batch)."""
        out = []
        while self.sub.poll(int(idle_timeout_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return out

    def request_replay(self, start_seq: int, timeout_s: float = 5.0) -> list[tuple[int, KVEventBatch]]:
        assert self.replay is not None
        self.replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        deadline = time.monotonic() + timeout_s
        while self.replay.poll(int(max(deadline - time.monotonic(), 0) * 1000)):
            _, seq, payload = self.replay.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                return out
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        raise TimeoutError("no end-of-replay marker")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def cached_hashes(batches: list[KVEventBatch], medium: str = "GPU") -> set[ExternalBlockHash]:
    """The block hashes a router believes cached in `medium` after these batches; a block stored
    twice, or removed while not stored, fails."""
    cached: set[ExternalBlockHash] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == medium:
                assert cached.isdisjoint(event.block_hashes), "a block stored twice"
                cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium == medium:
                assert cached.issuperset(event.block_hashes), "a block removed that was not stored"
                cached.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                cached.clear()
    return cached
