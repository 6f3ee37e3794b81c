"""The compiled grammars, least recently used first, bounded in bytes.

Many requests with one schema compile it once: the cache maps a constraint (backend, kind, spec,
switches) to the future of its compilation. A finished entry weighs its compiled grammar's size (the
grammar engine's estimate) plus its key's; once the entries weigh more than the bound the least
recently used finished ones go (a compilation still running is never evicted: its requests wait on
it). Without a bound, distinct schemas grew the engine by their compiled tables for good (300 schemas:
+146 MiB, vLLM's GHSA-hf3c-wxg2-49q9).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from typing import Any


class GrammarCache:
    """Not thread-safe: the manager holds its lock around every call."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Future[Any], int]] = OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Future[Any] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def add(self, key: Hashable, future: Future[Any]) -> None:
        """A compilation just started (it weighs nothing until `finished`)."""
        self._drop(key)
        self._entries[key] = (future, 0)

    def finished(self, key: Hashable, future: Future[Any], size: int) -> None:
        """``future``'s compilation is done and weighs ``size`` bytes; evict down to the bound (this
        entry too, when it alone is over it)."""
        entry = self._entries.get(key)
        if entry is None or entry[0] is not future:
            return  # evicted or replaced meanwhile
        self._entries[key] = (future, size)
        self.total_bytes += size
        while self.total_bytes > self.max_bytes:
            victim = next((k for k, (f, _) in self._entries.items() if f.done()), None)
            if victim is None:
                break
            self._drop(victim)

    def discard(self, key: Hashable, future: Future[Any]) -> None:
        """Forget ``future`` (a compilation that failed for a reason that may not hold next time)."""
        entry = self._entries.get(key)
        if entry is not None and entry[0] is future:
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.total_bytes -= entry[1]
