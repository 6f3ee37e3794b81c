"""The `mp` executor: one worker process per rank on this machine.

Calls go to the workers through one shared-memory message queue (`distributed.shm_broadcast`): the
call (a step's scheduler output included) is pickled and written once, and every worker reads it.
Each worker answers on its own pipe; `collective_rpc` waits on those pipes and on the processes'
sentinels together, so a worker that dies turns the call into an error naming its rank at once
(within the ~50 ms polling of the queue), never a hang. The workers are started with `spawn` (a
fresh interpreter: no forked torch or CUDA state), ignore the process group's SIGTERM and SIGINT
(`pagedllm.child_process`), die with the engine process (Linux `PR_SET_PDEATHSIG`), and are joined, then killed
if they do not exit, at shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import socket
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.child_process import die_with_parent, group_signals_held, init_child_process
from pagedllm.distributed.parallel_state import output_rank
from pagedllm.distributed.shm_broadcast import MessageQueue, QueueHandle
from pagedllm.executor.abstract import Executor, StepFuture, run_worker_method
from pagedllm.runtime_dir import make_runtime_dir

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.executor")

_SHUTDOWN = "__shutdown__"
# Seconds a worker may take to exit after the shutdown message before it is killed.
_JOIN_TIMEOUT = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine needed it."""


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_main(
    engine_config: EngineConfig, rank: int, init_method: str, handle: QueueHandle, conn: Connection
) -> None:
    """A worker process: build the worker, then run the calls the queue brings until shutdown."""
    init_child_process()
    die_with_parent()
    logger.info("worker %d started", rank)
    # Imported here: the spawned interpreter loads torch and the model code only in the workers.
    from pagedllm.worker.worker import Worker

    try:
        worker = Worker(engine_config, rank=rank, local_rank=rank, distributed_init_method=init_method)
        worker.init_device()
        worker.load_model()
        queue = MessageQueue.attach(handle, reader=rank)
    except ValueError as e:  # a broken model (ModelLoadError) or a bad setting: reported as it is
        conn.send(("invalid", e))
        return
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        while True:
            method, args, kwargs, reply_rank = queue.dequeue()
            if method == _SHUTDOWN:
                break
            try:
                result = run_worker_method(worker, method, args, kwargs)
                conn.send(("ok", result if reply_rank in (None, rank) else None))
            except ValueError as e:
                # The caller's mistake (a malformed adapter, a bad argument): the engine raises it as it
                # is, not as this worker's failure.
                conn.send(("invalid", e))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        worker.shutdown()
        queue.close()
    # Skip the interpreter's teardown: with torch's and gloo's threads it can take seconds, and the
    # worker has nothing left to flush.
    logging.shutdown()
    os._exit(0)


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (the server's engine core) start the workers: `multiprocessing`
    refuses children to daemons only so that they cannot be orphaned, which `PR_SET_PDEATHSIG` and
    the executor's shutdown already rule out here."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        pc = self.engine_config.parallel_config
        self.world_size: int = pc.world_size
        self.output_rank = output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        method = envs.PAGEDLLM_WORKER_MULTIPROC_METHOD or "spawn"
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            # The server imports the worker code once; each later world forks from it in milliseconds.
            ctx.set_forkserver_preload(["pagedllm.worker.worker", "transformers"])
        self.queue: MessageQueue | None = MessageQueue.create(self.world_size)
        # The ranks meet through a file store in a private directory: a TCP store listens on every
        # interface whatever address it is given, and all the ranks are on this machine.
        self._rendezvous_dir = make_runtime_dir("rendezvous")
        init_method = f"file://{os.path.join(self._rendezvous_dir, 'store')}"
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        # Steps submitted (`submit_step`) whose answers are still in the pipes, oldest first.
        self._unread_steps: deque[StepFuture] = deque()
        with _children_allowed():
            self._start_workers(ctx, init_method)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.queue, self._rendezvous_dir)
        try:
            self._collect(range(self.world_size), timeout=None)
        except BaseException:
            self.shutdown()
            raise
        logger.info("started %d worker processes (%s)", self.world_size, method)

    def _start_workers(self, ctx: Any, init_method: str) -> None:
        assert self.queue is not None
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main,
                args=(self.engine_config, rank, init_method, self.queue.handle, theirs),
                name=f"pagedllm-worker-{rank}",
                daemon=True,
            )
            with group_signals_held():
                proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)

    def _check_alive(self) -> None:
        dead = [(rank, p) for rank, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            raise WorkerDiedError(
                "; ".join(f"worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}" for rank, p in dead)
            )

    def _collect(self, ranks: range | list[int], timeout: float | None) -> list[Any]:
        """Each rank's answer to the last call, in rank order; an error if one failed or died."""
        pending = {self.conns[r]: r for r in ranks}
        results: dict[int, Any] = {}
        errors: list[str] = []
        invalid: list[ValueError] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*pending, *sentinels], timeout=left)
            if not ready:
                raise TimeoutError(f"workers {sorted(pending.values())} did not answer within {timeout} s")
            for conn in ready:
                if conn in sentinels:
                    continue
                rank = pending.pop(conn)  # type: ignore[index]
                try:
                    status, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    # Its pipe closed: the process is exiting, and its sentinel may not be ready yet
                    # (leaving the loop here lost the rank's answer: a KeyError instead of its name).
                    self.procs[rank].join(_JOIN_TIMEOUT)
                    self._check_alive()
                    raise WorkerDiedError(f"worker rank {rank} (pid {self.procs[rank].pid}) closed its pipe") from None
                if status == "ok":
                    results[rank] = value
                elif status == "invalid":
                    invalid.append(value)
                else:
                    errors.append(f"worker rank {rank} failed:\n{value}")
            if any(s in ready for s in sentinels):
                self._check_alive()
        if errors:
            raise RuntimeError("\n".join(errors))
        if invalid:  # every rank refuses the same arguments
            raise invalid[0]
        return [results[r] for r in ranks]

    def _broadcast(self, message: tuple[Any, ...]) -> None:
        if self.queue is None:
            raise RuntimeError("the executor was shut down")
        self.queue.enqueue(message, alive=self._check_alive)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if self._unread_steps:  # their answers come first in the pipes
            self._read_steps(None)
        self._broadcast((method, args, kwargs or {}, None))
        return self._collect(range(self.world_size), timeout)

    def _output_rpc(self, method: str, arg: Any) -> Any:
        """A step call whose result only the output rank sends back (the others answer None)."""
        self._broadcast((method, (arg,), {}, self.output_rank))
        return self._collect(range(self.world_size), None)[self.output_rank]

    def execute_model(self, scheduler_output: Any) -> None:
        self._output_rpc("execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> Any:
        return self._output_rpc("sample_tokens", grammar_output)

    def submit_step(self, scheduler_output: Any, grammar_output: Any) -> StepFuture:
        # Both calls go out now: a stage that is done with the step goes on to the next one queued.
        self._broadcast(("execute_model", (scheduler_output,), {}, self.output_rank))
        self._broadcast(("sample_tokens", (grammar_output,), {}, self.output_rank))
        future = StepFuture(self._read_steps)
        self._unread_steps.append(future)
        return future

    def _read_steps(self, until: StepFuture | None) -> None:
        """Read the answers of the submitted steps, oldest first, up to `until` (None: all of them).
        After a failure the later steps fail too: the workers' order is lost."""
        ranks = range(self.world_size)
        while self._unread_steps:
            future = self._unread_steps.popleft()
            try:
                self._collect(ranks, None)  # execute_model
                future.set_result(self._collect(ranks, None)[self.output_rank])
            except BaseException as e:
                for failed in (future, *self._unread_steps):
                    failed.set_exception(e)
                self._unread_steps.clear()
                raise
            if future is until:
                return

    def shutdown(self) -> None:
        if self.queue is not None:
            self._finalizer()
            self.queue = None
            for conn in self.conns:
                conn.close()


def _stop(procs: list[BaseProcess], queue: MessageQueue, rendezvous_dir: str) -> None:
    """Ask the workers to exit and wait for them (when all are alive: after a death the others may
    be blocked in a collective with the dead one), then kill what is left; free the queue and the
    rendezvous directory."""
    if all(p.is_alive() for p in procs):
        try:
            queue.enqueue((_SHUTDOWN, (), {}, None), alive=lambda: _raise_if_any_dead(procs))
            deadline = time.monotonic() + _JOIN_TIMEOUT
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        except WorkerDiedError:
            pass
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(1.0)
    queue.close()
    shutil.rmtree(rendezvous_dir, ignore_errors=True)


def _raise_if_any_dead(procs: list[BaseProcess]) -> None:
    if not all(p.is_alive() for p in procs):
        raise WorkerDiedError("a worker died")
