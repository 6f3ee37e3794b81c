"""The engine's side of grammar compilation in child processes, each compilation under a deadline.

xgrammar cannot be interrupted: a grammar that took it minutes held its thread for minutes, and with it
every constrained request queued behind it. Here grammars compile in the compile server's forked
workers (`compile_server.py`), which kill a worker whose grammar is not compiled by its deadline. The
server is started with the first constraint to compile (its start, which imports the grammar engines,
counts against no deadline), as a fresh interpreter: forking the engine (threads, maybe a GPU context)
is not safe, and `multiprocessing`'s spawn and forkserver would import the user's `__main__` again.
Jobs and results travel as msgpack over two private pipes (no other process inherits them), and nothing
is pickled: the server receives constraint text and the vocabulary's tokenizer info, and sends back
compiled grammars as JSON; a reader thread hands each result to its waiter. The server follows the
engine, not the process group (it ignores SIGTERM and SIGINT), and exits when the engine does: at end of
file on its pipe, or by `PR_SET_PDEATHSIG`, which fires when the thread that started it ends (one of the
manager's pool threads, which live as long as the engine; the API server's event-loop thread for its
`ConstraintChecker`, which uses a server of its own).
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from pagedllm.child_process import group_signals_held
from pagedllm.errors import RequestError
from pagedllm.structured_output.backends import BACKEND_CLASSES
from pagedllm.structured_output.compile_server import READY, Init, Job, Result
from pagedllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("pagedllm.structured_output")

# Beyond its deadline, how long a job may take to come back before the server counts as hung: forking a
# worker and building a compiler from an Init, on a loaded machine.
GRACE_S = 60.0
# How long the server may take to start (import the grammar engines and torch) on a loaded machine.
START_TIMEOUT_S = 600.0


class CompileTimeoutError(RequestError):
    """A grammar did not compile within its deadline (its worker was killed)."""


class CompileWorkerError(RuntimeError):
    """The compile worker or server died (crashed, or was killed from outside) while compiling."""


class _Server:
    """One compile server process, its pipes, and the jobs waiting for an answer."""

    def __init__(self, max_workers: int, memory_mb: int) -> None:
        ours_r, theirs_w = os.pipe()
        theirs_r, ours_w = os.pipe()
        try:
            args = [str(theirs_r), str(theirs_w), str(os.getpid()), str(max_workers), str(memory_mb)]
            # Group signals held until the server ignores them: it follows the engine, not the group.
            with group_signals_held():
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "pagedllm.structured_output.compile_server", *args],
                    pass_fds=(theirs_r, theirs_w),
                    stdin=subprocess.DEVNULL,
                )
        except BaseException:
            for fd in (ours_r, ours_w):
                os.close(fd)
            raise
        finally:
            os.close(theirs_r)
            os.close(theirs_w)
        self.to_server = Connection(ours_w, readable=False)
        self.from_server = Connection(ours_r, writable=False)
        self.lock = threading.Lock()
        self.pending: dict[int, Future[Result]] = {}
        self.backends: set[str] = set()
        self.dead = False
        # Set once the server has imported the grammar engines (its first message).
        self.ready = threading.Event()
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="pagedllm-grammar-results", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(Result)
        try:
            while True:
                result = decoder.decode(self.from_server.recv_bytes())
                if result.job_id == READY:
                    self.ready.set()
                    continue
                with self.lock:
                    future = self.pending.pop(result.job_id, None)
                if future is not None:
                    future.set_result(result)
        except (EOFError, OSError):
            pass
        with self.lock:
            self.dead = True
            pending, self.pending = self.pending, {}
        self.ready.set()  # no one waits for a dead server
        error = CompileWorkerError(f"the grammar compile server exited (exit code {self.proc.poll()})")
        for future in pending.values():
            future.set_exception(error)

    def send(self, message: Init | Job) -> Future[Result] | None:
        """Send ``message``; for a Job, the future of its result."""
        future: Future[Result] | None = None
        with self.lock:
            if self.dead:
                raise CompileWorkerError("the grammar compile server exited")
            if isinstance(message, Job):
                message.job_id = next(self._ids)
                future = self.pending[message.job_id] = Future()
                # Running: it cannot be cancelled (an asyncio waiter that gives up cancels what it wraps),
                # so the reader can always set its result.
                future.set_running_or_notify_cancel()
            try:
                self.to_server.send_bytes(msgspec.msgpack.encode(message))
            except OSError as e:
                self.dead = True
                raise CompileWorkerError("the grammar compile server exited") from e
        return future

    def mark_hung(self, waited_s: float) -> None:
        """The server did not answer a job in ``waited_s`` seconds: the next start replaces it."""
        logger.error("the grammar compile server did not answer in %.0f s: restarting it", waited_s)
        with self.lock:
            self.dead = True

    def stop(self) -> None:
        """Close the pipes (the server kills its workers and exits) and reap the server; one already
        dead (exited, or hung) is killed at once."""
        self.to_server.close()
        try:
            self.proc.wait(0 if self.dead else 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.from_server.close()


class CompileClient:
    """The compile server, started when a constraint first needs it; ``compile`` may be called from
    several threads at once (as many as there are workers). Each worker may allocate ``memory_mb`` MiB
    beyond what it starts with (0: unbounded)."""

    def __init__(self, max_workers: int, memory_mb: int) -> None:
        self.max_workers = max_workers
        self.memory_mb = memory_mb
        self._lock = threading.Lock()
        # Held while a compiler's data is built and sent (the tokenizer may load: seconds).
        self._init_lock = threading.Lock()
        self._server: _Server | None = None
        self._closed = False
        # An engine dropped without shutdown (an offline LLM going out of scope) leaves no process behind.
        self._finalizer = weakref.finalize(self, _stop, [None])

    def start(self) -> _Server:
        """The running server (started now if there is none: seconds, it imports the grammar engines)."""
        server = self.spawn()
        if not server.ready.wait(START_TIMEOUT_S) or server.dead:
            raise CompileWorkerError(
                f"the grammar compile server did not start (exit code {server.proc.poll()})"
            )
        return server

    def spawn(self) -> _Server:
        """The server, started now if there is none, perhaps not ready yet (``ready`` tells). It dies with
        the thread that started it: call this from a thread that lives as long as the client."""
        with self._lock:
            if self._closed:
                raise CompileWorkerError("the engine is shutting down")
            if self._server is None or self._server.dead:
                if self._server is not None:
                    self._server.stop()
                self._server = _Server(self.max_workers, self.memory_mb)
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _stop, [self._server])
            return self._server

    def compile(
        self,
        params: StructuredOutputsParams,
        config: Any,
        worker_init: Callable[[str], str | None],
        timeout: float,
    ) -> tuple[str, str]:
        """(backend, compiled grammar as text) for ``params``; RequestError naming the field for a bad
        constraint, CompileTimeoutError for one not compiled within ``timeout`` seconds.
        ``worker_init(backend)`` is what a worker builds that backend's compiler from."""
        server = self.start()
        needed = [params.resolved_backend] if params.resolved_backend else _candidates(config.backend)
        with self._init_lock:
            for name in needed:
                if name not in server.backends:
                    data = worker_init(name)
                    if data is not None:
                        server.send(Init(name, data))
                    server.backends.add(name)
        job = Job(0, params, config.backend, config.disable_fallback, timeout)
        future = server.send(job)
        assert future is not None
        try:
            result = future.result(timeout + GRACE_S)
        except TimeoutError:
            server.mark_hung(timeout + GRACE_S)
            raise CompileWorkerError("the grammar compile server did not answer") from None
        return outcome(
            result,
            f"structured_outputs.{params.kind} did not compile within {timeout:g} s "
            "(structured_outputs_config.compile_timeout_s): simplify the constraint",
        )

    def server_pid(self) -> int | None:
        with self._lock:
            return None if self._server is None or self._server.dead else self._server.proc.pid

    def close(self) -> None:
        """Stop the server and its workers (compilations under way fail)."""
        with self._lock:
            self._closed = True
        self._finalizer()


def outcome(result: Result, timeout_message: str) -> tuple[str, str]:
    """(backend, payload) of a job's result; else CompileTimeoutError with ``timeout_message`` for a job
    past its deadline, CompileWorkerError for a worker that died, RequestError for a bad constraint or
    one that needs more memory than a worker may use."""
    if result.status == "ok":
        return result.backend, result.payload
    if result.status == "timeout":
        raise CompileTimeoutError("structured_outputs", timeout_message)
    if result.status == "died":
        raise CompileWorkerError(f"the grammar compile worker died ({result.error})")
    # "error", "memory": the constraint's fault
    raise RequestError("structured_outputs", result.error)


def _stop(servers: list[_Server | None]) -> None:
    for server in servers:
        if server is not None:
            server.stop()


def _candidates(configured: str) -> list[str]:
    return [configured] if configured in BACKEND_CLASSES else list(BACKEND_CLASSES)
