"""The multiprocess executor's answer collection when a worker dies mid-call or refuses a call."""

from __future__ import annotations

import multiprocessing
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pagedllm.executor.multiproc import MultiprocExecutor, WorkerDiedError
from pagedllm.lora.peft_loader import LoRAAdapterError


def _exit_later(code: int, started: Any) -> None:
    started.set()
    time.sleep(0.5)
    # At once: an interpreter that imported torch can take seconds to tear down on a loaded machine,
    # past the executor's wait for a process whose pipe closed.
    os._exit(code)


def test_closed_pipe_before_the_exit_names_the_rank() -> None:
    """A dying worker's pipe closes before its process has exited (its sentinel not yet ready): the
    call fails naming the rank and its exit, never with the rank's answer silently missing."""
    ctx = multiprocessing.get_context("spawn")
    alive_out, alive_in = ctx.Pipe(duplex=False)
    dying_out, dying_in = ctx.Pipe(duplex=False)
    alive = ctx.Process(target=time.sleep, args=(30,), daemon=True)
    started = ctx.Event()
    dying = ctx.Process(target=_exit_later, args=(3, started), daemon=True)
    alive.start()
    dying.start()
    try:
        # A spawned child takes seconds to import on a loaded machine: its half second starts only now,
        # well within the executor's wait for a process whose pipe closed.
        assert started.wait(120)
        alive_in.send(("ok", "answer of rank 0"))
        dying_in.close()  # rank 1's end closes while the process still runs
        executor = SimpleNamespace(procs=[alive, dying], conns=[alive_out, dying_out])
        executor._check_alive = lambda: MultiprocExecutor._check_alive(executor)  # type: ignore[arg-type]
        with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {dying.pid}\) died with exit code 3"):
            MultiprocExecutor._collect(executor, range(2), timeout=10.0)  # type: ignore[arg-type]
    finally:
        alive.kill()
        dying.kill()
        alive.join()
        dying.join()


def test_a_refused_call_stays_a_value_error() -> None:
    """Workers that refuse a call (a ValueError there: a malformed LoRA adapter, a broken model) raise
    that error here too, which front-ends answer as the caller's mistake (400, one line) rather than as a
    worker's failure."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=time.sleep, args=(30,), daemon=True) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        for _, sender in pipes:
            sender.send(("invalid", LoRAAdapterError("LoRA adapter '/a' has no adapter_config.json")))
        executor = SimpleNamespace(procs=procs, conns=[receiver for receiver, _ in pipes])
        executor._check_alive = lambda: MultiprocExecutor._check_alive(executor)  # type: ignore[arg-type]
        with pytest.raises(LoRAAdapterError, match="^LoRA adapter '/a' has no adapter_config.json$"):
            MultiprocExecutor._collect(executor, range(2), timeout=10.0)  # type: ignore[arg-type]
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
