"""The engine core's busy loop (no model: a stand-in core): while every request waits for its grammar it
sleeps instead of stepping back to back, reports the waiting requests, and wakes up as soon as a grammar
compiles."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq

from pagedllm.engine import core_proc
from pagedllm.engine.protocol import EngineCoreOutputs, SchedulerStats


class _Done(Exception):
    """Ends the busy loop once the stand-in's request finished."""


class GrammarWaitingCore:
    """One request whose grammar compiles when `compile()` is called (the manager's listeners run then,
    as they do from its pool thread); a step after that finishes it."""

    def __init__(self) -> None:
        self.engine_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0))
        self.listeners: list[Callable[[], None]] = []
        self.structured_output_manager = SimpleNamespace(add_ready_listener=self.listeners.append)
        self.scheduler = SimpleNamespace(make_stats=self._stats, running=[])
        self.compiled = threading.Event()
        self.steps = 0
        self.finished_at: float | None = None

    def _stats(self) -> SchedulerStats:
        return SchedulerStats(num_waiting_reqs=0 if self.compiled.is_set() else 1)

    def compile(self) -> None:
        self.compiled.set()
        for listener in self.listeners:
            listener()

    def has_unfinished_requests(self) -> bool:
        return True

    def waiting_for_grammars(self) -> bool:
        return not self.compiled.is_set()

    def step(self) -> EngineCoreOutputs:
        self.steps += 1
        if self.compiled.is_set():
            self.finished_at = time.monotonic()
            raise _Done
        return EngineCoreOutputs()

    def defers(self, method: str) -> bool:
        return False

    def shutdown(self) -> None:
        pass


@pytest.fixture
def sockets() -> Iterator[tuple[str, str, Any]]:
    """The front-end's ends of the core's two sockets (bound, so that the core's sends go somewhere)."""
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="pagedllm-core-proc-") as tmp:
        input_addr, output_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(input_addr)
        pull.bind(output_addr)
        try:
            yield input_addr, output_addr, pull
        finally:
            push.close(0)
            pull.close(0)
            ctx.term()


def test_the_loop_sleeps_while_every_request_waits_for_its_grammar(
    sockets: tuple[str, str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long poll: only the grammar's wake-up can end the wait promptly.
    monkeypatch.setattr(core_proc, "_IDLE_POLL_S", 5.0)
    input_addr, output_addr, pull = sockets
    core = GrammarWaitingCore()
    proc = core_proc.EngineCoreProc(core, input_addr, output_addr, os.getppid())  # type: ignore[arg-type]
    loop = threading.Thread(target=lambda: pytest.raises(_Done, proc.run_busy_loop), daemon=True)
    try:
        loop.start()
        time.sleep(1.0)
        # Stepping back to back made tens of thousands of steps (and stats messages) a second.
        assert core.steps <= 3, core.steps
        compiled_at = time.monotonic()
        core.compile()
        loop.join(30)
        assert not loop.is_alive() and core.finished_at is not None
        # Woken by the compiled grammar, not by the 5 s poll (generous for a loaded machine).
        assert core.finished_at - compiled_at < 2.5
        # The front-end heard that the request was waiting.
        assert pull.poll(5000)
        kind, payload = pull.recv_multipart()
        assert kind == core_proc.OutputKind.OUTPUTS.value
        stats = msgspec.msgpack.decode(payload, type=EngineCoreOutputs).scheduler_stats
        assert stats is not None and stats.num_waiting_reqs == 1
    finally:
        proc.shutdown()
