"""The grammar compile server: a child process of the engine that compiles grammars in forked workers,
each compilation under a deadline. The API server has one too, for its check of a request's constraint
(a `check_only` job: the grammar engine's conversion, without a vocabulary), so that a check past its
deadline is killed as well.

`python -m pagedllm.structured_output.compile_server READ_FD WRITE_FD PARENT_PID MAX_WORKERS MEMORY_MB`,
started by `compile_client.CompileClient`. It imports the grammar engines once, then forks a worker per slot (a
fork of this single-threaded process is safe and takes milliseconds; the engine itself has threads and
perhaps a GPU context, and is never forked). A job is handed to an idle worker; a worker that has not
answered when the job's deadline passes is killed (SIGKILL: xgrammar cannot be interrupted) and the job
answered with a timeout, and the next job forks a fresh worker. A worker may allocate MEMORY_MB MiB
beyond what it inherits (`RLIMIT_DATA`; 0: unbounded): a grammar that needs more fails with an error
saying so instead of taking the host's memory (an allocation xgrammar cannot make is an exception; one
llguidance cannot make ends the worker), and its worker is replaced. The compilers the engine sends
(`Init`: the vocabulary's tokenizer info) are built here, before the forks that inherit them. Every
message is msgpack over pipes (nothing is pickled); the server and its workers die with the engine.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import resource
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

import msgspec

from pagedllm.child_process import die_with_parent, ignore_group_signals
from pagedllm.structured_output.backends import BACKEND_CLASSES, resolve_backend
from pagedllm.structured_output.params import StructuredOutputsParams

# The job id of the server's first message: it has imported the grammar engines and takes jobs.
READY = -1


class Init(msgspec.Struct, tag=True):
    """Build ``backend``'s compiler from ``data`` (what `worker_init()` of that backend returned)."""

    backend: str
    data: str


class Job(msgspec.Struct, tag=True):
    job_id: int
    params: StructuredOutputsParams
    # The configured backend ("auto", "xgrammar", "guidance") and its fallback switch, for a constraint
    # whose backend the front-end did not resolve.
    backend: str
    disable_fallback: bool
    timeout_s: float
    # Only resolve the backend (which converts, and so validates, the constraint): the front-end's check.
    check_only: bool = False


class Result(msgspec.Struct):
    job_id: int
    # "ok": `backend` compiled it into `payload`; "error": `error` names the field; "memory": it needs
    # more memory than a worker may use (`error` says so; the worker is replaced); "timeout": the worker
    # was killed at the deadline; "died": the worker died on its own.
    status: Literal["ok", "error", "memory", "timeout", "died"]
    backend: str = ""
    payload: str = ""
    error: str = ""


class _Worker:
    def __init__(
        self,
        ctx: Any,
        compilers: dict[str, Any],
        generation: int,
        engine_pipes: list[Connection],
        memory_mb: int,
    ) -> None:
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(theirs, compilers, engine_pipes, memory_mb), daemon=True
        )
        self.proc.start()
        theirs.close()
        self.generation = generation
        self.job: Job | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


class CompileServer:
    def __init__(
        self, engine_in: Connection, engine_out: Connection, max_workers: int, memory_mb: int
    ) -> None:
        self.engine_in = engine_in
        self.engine_out = engine_out
        self.max_workers = max_workers
        self.memory_mb = memory_mb
        self.ctx = multiprocessing.get_context("fork")
        self.compilers: dict[str, Any] = {}
        # Bumped by each Init: workers forked before it lack that compiler and are retired when idle.
        self.generation = 0
        self.idle: list[_Worker] = []
        self.busy: dict[Connection, _Worker] = {}
        self.queue: collections.deque[Job] = collections.deque()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Init | Job)

    def serve(self) -> None:
        self._reply(Result(READY, "ok"))
        while True:
            self._dispatch()
            deadlines = [w.deadline for w in self.busy.values()]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for conn in wait([self.engine_in, *self.busy], timeout):
                if conn is self.engine_in:
                    if not self._receive():
                        return
                else:
                    self._collect(self.busy.pop(conn))  # type: ignore[index]
            now = time.monotonic()
            for conn, worker in list(self.busy.items()):
                if worker.deadline <= now:
                    del self.busy[conn]
                    worker.kill()
                    self._reply(Result(worker.job.job_id, "timeout"))  # type: ignore[union-attr]

    def _receive(self) -> bool:
        """Handle one message from the engine; False once the engine has closed its end."""
        try:
            message = self.decoder.decode(self.engine_in.recv_bytes())
        except EOFError:
            return False
        if isinstance(message, Init):
            self.compilers[message.backend] = BACKEND_CLASSES[message.backend].make_compiler(message.data)
            self.generation += 1
            for worker in self.idle:
                worker.kill()
            self.idle.clear()
        else:
            self.queue.append(message)
        return True

    def _dispatch(self) -> None:
        while self.queue and (self.idle or len(self.busy) < self.max_workers):
            worker = (
                self.idle.pop()
                if self.idle
                else _Worker(
                    self.ctx,
                    self.compilers,
                    self.generation,
                    [self.engine_in, self.engine_out],
                    self.memory_mb,
                )
            )
            job = self.queue.popleft()
            worker.job, worker.deadline = job, time.monotonic() + job.timeout_s
            try:
                worker.conn.send_bytes(self.encoder.encode(job))
            except OSError:  # died while idle
                worker.kill()
                self._reply(Result(job.job_id, "died", error=f"exit code {worker.proc.exitcode}"))
                continue
            self.busy[worker.conn] = worker

    def _collect(self, worker: _Worker) -> None:
        job = worker.job
        assert job is not None
        try:
            answer = msgspec.msgpack.decode(worker.conn.recv_bytes(), type=Result)
        except EOFError:
            worker.kill()
            self._reply(Result(job.job_id, "died", error=self._death(worker)))
            return
        answer.job_id = job.job_id
        self._reply(answer)
        worker.job = None
        # One that ran out of memory may hold on to a fragmented heap: a fresh one takes the next job.
        if worker.generation == self.generation and answer.status != "memory":
            self.idle.append(worker)
        else:
            worker.kill()

    def _death(self, worker: _Worker) -> str:
        code = worker.proc.exitcode
        cause = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if self.memory_mb:
            cause += (
                f"; a worker whose grammar needs more than {self.memory_mb} MiB "
                "(PAGEDLLM_GRAMMAR_COMPILE_MEMORY_MB) may end so"
            )
        return cause

    def _reply(self, result: Result) -> None:
        self.engine_out.send_bytes(self.encoder.encode(result))

    def shutdown(self) -> None:
        for worker in [*self.idle, *self.busy.values()]:
            worker.kill()


def _worker_main(
    conn: Connection, compilers: dict[str, Any], engine_pipes: list[Connection], memory_mb: int
) -> None:
    die_with_parent()
    # The server's pipes to the engine, inherited by the fork: a worker holding them open would hide the
    # server's death from the engine (no end-of-file while the worker lives).
    for pipe in engine_pipes:
        pipe.close()
    _bound_memory(memory_mb)
    decoder = msgspec.msgpack.Decoder(Job)
    encoder = msgspec.msgpack.Encoder()
    while True:
        try:
            job = decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break
        conn.send_bytes(encoder.encode(_compile(job, compilers, memory_mb)))
    os._exit(0)


def _bound_memory(memory_mb: int) -> None:
    """Let this process allocate at most ``memory_mb`` MiB more than it has now (0: no bound). The bound is
    on its data (`RLIMIT_DATA`: heap and private writable mappings, Linux 4.7 on), not its address space,
    which the imported libraries reserve generously without using."""
    if memory_mb <= 0:
        return
    try:
        with open("/proc/self/status") as status:
            data_kib = next(int(line.split()[1]) for line in status if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):  # not Linux: unbounded
        return
    limit = data_kib * 1024 + memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _compile(job: Job, compilers: dict[str, Any], memory_mb: int) -> Result:
    params = job.params
    try:
        backend = params.resolved_backend or resolve_backend(params, job.backend, job.disable_fallback)
        if job.check_only:
            return Result(job.job_id, "ok", backend)
        payload = BACKEND_CLASSES[backend].compile_payload(params, compilers.get(backend))
        return Result(job.job_id, "ok", backend, payload)
    except MemoryError:
        error = (
            f"structured_outputs.{params.kind} needs more memory than a grammar compile worker may use "
            f"({memory_mb} MiB, PAGEDLLM_GRAMMAR_COMPILE_MEMORY_MB): simplify the constraint"
        )
        return Result(job.job_id, "memory", error=error)
    except ValueError as e:
        return Result(job.job_id, "error", error=str(e))
    except Exception as e:  # only this constraint fails, whatever the grammar engine raised
        error = f"structured_outputs.{params.kind} could not be compiled: {type(e).__name__}: {e}"
        return Result(job.job_id, "error", error=error)


def main(argv: list[str]) -> None:
    read_fd, write_fd, parent_pid, max_workers, memory_mb = (int(a) for a in argv)
    die_with_parent()
    if os.getppid() != parent_pid:  # the engine died before the death signal was armed
        os._exit(1)
    # SIGTERM and SIGINT reach the whole process group: the engine decides when the server stops (its
    # workers inherit this).
    ignore_group_signals()
    # Imported before any fork: every worker inherits them.
    import llguidance  # noqa: F401
    import xgrammar  # noqa: F401

    server = CompileServer(
        Connection(read_fd, writable=False), Connection(write_fd, readable=False), max_workers, memory_mb
    )
    try:
        server.serve()
    finally:
        server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
