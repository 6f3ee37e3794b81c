"""The multiprocess executor's answer collection when a worker dies mid-call."""

from __future__ import annotations

import multiprocessing
import time
from types import SimpleNamespace

import pytest

from pagedllm.executor.multiproc import MultiprocExecutor, WorkerDiedError


def _exit_later(code: int) -> None:
    time.sleep(0.5)
    raise SystemExit(code)


def test_closed_pipe_before_the_exit_names_the_rank() -> None:
    """A dying worker's pipe closes before its process has exited (its sentinel not yet ready): the
    call fails naming the rank and its exit, never with the rank's answer silently missing."""
    ctx = multiprocessing.get_context("spawn")
    alive_out, alive_in = ctx.Pipe(duplex=False)
    dying_out, dying_in = ctx.Pipe(duplex=False)
    alive = ctx.Process(target=time.sleep, args=(30,), daemon=True)
    dying = ctx.Process(target=_exit_later, args=(3,), daemon=True)
    alive.start()
    dying.start()
    try:
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
