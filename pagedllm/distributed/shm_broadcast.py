"""A one-writer, many-reader message queue in shared memory: how the `mp` executor broadcasts each
step's call (the scheduler output) to its workers.

The message is pickled once and written once into a ring of fixed-size slots in a
`multiprocessing.shared_memory` block; every reader copies it out of the same slots. A message larger
than a slot takes several consecutive slots. Why not a pipe per worker: that pickles and copies the
scheduler output once per worker per step, and wakes each worker through the kernel.

Layout: `num_slots` data slots of `slot_bytes`, then per slot `[sequence number, bytes, last chunk]`
(int64, written by the writer, the sequence number last so a reader never sees a half-written slot;
x86 and ARM64 keep 8-byte aligned stores whole), then per reader and slot the last sequence number it
consumed (the writer reuses a slot only when every reader has consumed it).

Waiting is polling: a short spin (a step's next call usually arrives within microseconds), then
sleeps growing to 1 ms, so an idle worker costs almost nothing. Every wait takes an `alive()` check,
run every ~50 ms, that raises when the other side has died: a dead peer is an error, never a hang.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

_HEADER = 3  # int64 fields per slot: sequence number, payload bytes, last-chunk flag
_SPIN = 200
_MAX_SLEEP = 1e-3
_CHECK_EVERY = 0.05


@dataclass(frozen=True)
class QueueHandle:
    """What a reader needs to attach (picklable, sent to the worker processes)."""

    name: str
    num_slots: int
    slot_bytes: int
    num_readers: int


def _wait(ready: Callable[[], bool], alive: Callable[[], None] | None, timeout: float | None) -> None:
    for _ in range(_SPIN):
        if ready():
            return
        time.sleep(0)
    start = last_check = time.monotonic()
    sleep = 1e-5
    while not ready():
        now = time.monotonic()
        if now - last_check > _CHECK_EVERY:
            last_check = now
            if alive is not None:
                alive()
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"no message in {timeout} s")
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP)


class MessageQueue:
    def __init__(self, handle: QueueHandle, shm: shared_memory.SharedMemory, reader: int | None) -> None:
        self.handle = handle
        self._shm = shm
        self._reader = reader
        n, size = handle.num_slots, handle.slot_bytes
        data_bytes = n * size
        self._data = shm.buf[:data_bytes]
        self._header = np.ndarray((n, _HEADER), np.int64, buffer=shm.buf, offset=data_bytes)
        self._consumed = np.ndarray(
            (handle.num_readers, n), np.int64, buffer=shm.buf, offset=data_bytes + n * _HEADER * 8
        )
        # The sequence number of the last chunk written (writer) or read (reader).
        self._seq = 0

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> MessageQueue:
        """The writer's end: a new shared block (zeroed by the OS)."""
        size = num_slots * (slot_bytes + _HEADER * 8) + num_readers * num_slots * 8
        shm = shared_memory.SharedMemory(create=True, size=size)
        return cls(QueueHandle(shm.name, num_slots, slot_bytes, num_readers), shm, None)

    @classmethod
    def attach(cls, handle: QueueHandle, reader: int) -> MessageQueue:
        """Reader `reader`'s end of the queue `handle` names."""
        # Workers started by `multiprocessing` share the writer's resource tracker, where attaching
        # registers the same name again (a set: no second entry); the writer's unlink removes it.
        return cls(handle, shared_memory.SharedMemory(name=handle.name), reader)

    def enqueue(self, obj: Any, alive: Callable[[], None] | None = None) -> None:
        """Write `obj` for every reader (blocks while a slot it needs is still unread)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n, size = self.handle.num_slots, self.handle.slot_bytes
        view = memoryview(payload)
        for start in range(0, max(len(payload), 1), size):
            self._seq += 1
            slot = self._seq % n
            reusable = self._seq - n
            _wait(lambda s=slot, r=reusable: bool((self._consumed[:, s] >= r).all()), alive, None)
            chunk = view[start : start + size]
            self._data[slot * size : slot * size + len(chunk)] = chunk
            header = self._header[slot]
            header[1] = len(chunk)
            header[2] = start + size >= len(payload)
            header[0] = self._seq

    def dequeue(self, alive: Callable[[], None] | None = None, timeout: float | None = None) -> Any:
        """The next message (blocks until it is written)."""
        assert self._reader is not None, "the writer's end cannot read"
        n, size = self.handle.num_slots, self.handle.slot_bytes
        parts: list[bytes] = []
        while True:
            seq = self._seq + 1
            slot = seq % n
            header = self._header[slot]
            _wait(lambda h=header, q=seq: int(h[0]) == q, alive, timeout)
            nbytes, last = int(header[1]), bool(header[2])
            parts.append(bytes(self._data[slot * size : slot * size + nbytes]))
            self._consumed[self._reader, slot] = seq
            self._seq = seq
            if last:
                return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        """Detach; the writer also removes the block."""
        del self._header, self._consumed
        self._data.release()
        self._shm.close()
        if self._reader is None:
            self._shm.unlink()
