"""Publishing KV cache events (`kv_events_config`) the way vLLM's ZmqEventPublisher does.

Each published message is three frames on a ZMQ PUB socket: the topic, the batch's sequence number
(8 bytes, big-endian, from 0 with no gaps) and the msgpack-encoded `KVEventBatch`. The last
`buffer_steps` batches stay in memory: a subscriber that noticed a gap in the sequence numbers asks the
ROUTER socket at `replay_endpoint` for everything from a sequence number on (a REQ message of 8
big-endian bytes) and receives `(seq, payload)` pairs, then `(-1, b"")`.

Encoding and sending run on a thread of their own, fed by a bounded queue: the engine step only
enqueues the batch (it waits only when `max_queue_size` batches are already pending).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from itertools import count
from typing import TYPE_CHECKING

import msgspec
import zmq

from pagedllm.core.kv_events import EventBatch, KVCacheEvent, KVEventBatch

if TYPE_CHECKING:
    from pagedllm.config.kv_transfer import KVEventsConfig

logger = logging.getLogger("pagedllm.kv_events")

# The replay stream's end marker: sequence number -1 and an empty payload.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    """Drops every batch ("null" publisher; the base of the real ones)."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    def publish_events(self, events: list[KVCacheEvent]) -> None:
        """Publish one step's events as one batch (nothing when there are none)."""
        if events:
            self.publish(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank))

    def publish(self, batch: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


def _binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (a local transport, a wildcard, or an address of this
    machine, the loopback default included) or connects to it (another machine's address: a relay or
    a subscriber that binds)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        return True
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)  # only an address of this machine can be bound
        return True
    except OSError:
        return False


class ZmqEventPublisher(EventPublisher):
    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        data_parallel_rank: int = 0,
    ) -> None:
        super().__init__(data_parallel_rank)
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {endpoint!r} / {replay_endpoint!r}: {e}") from e
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("publishing KV cache events on %s (topic %r)", endpoint, topic)

    def publish(self, batch: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        self._queue.put(batch)

    def shutdown(self) -> None:
        """Send what is queued (for at most SHUTDOWN_TIMEOUT_S), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV event publisher: %d batches unsent at shutdown", self._queue.qsize())
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(seqs)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                # The batch keeps its number: a subscriber sees the gap and can replay it.
                logger.exception("KV event batch %d not sent", seq)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of one data parallel rank: each engine core publishes on its own (vLLM's rule: a TCP
    port grows by the rank, other transports get a `_dp<rank>` suffix); rank 0 keeps the configured one."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        address, port = endpoint.rsplit(":", 1)
        return f"{address}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def make_event_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher `kv_events_config` asks for (the null one unless events are on with "zmq")."""
    if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
        return EventPublisher(data_parallel_rank)
    replay = config.replay_endpoint
    return ZmqEventPublisher(
        offset_endpoint(config.endpoint, data_parallel_rank),
        None if replay is None else offset_endpoint(replay, data_parallel_rank),
        config.buffer_steps,
        config.hwm,
        config.max_queue_size,
        config.topic,
        data_parallel_rank,
    )
