"""Client side of the engine core process: start it, send requests and aborts, receive outputs.

`EngineCoreProcess` spawns the child (`pagedllm.engine.core_proc.run_engine_core_process`) before the
configuration exists, so that the child's imports overlap with the front-end's; `AsyncMPClient` sends it
the configuration, waits for its READY handshake, then exchanges msgspec messages with it over ZMQ from
the asyncio event loop. A monitor thread waits on the child's process sentinel, so a dead core (crash,
OOM kill, kill -9) is noticed at once: pending and later calls fail with `EngineDeadError` instead of
waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.child_process import group_signals_held
from pagedllm.engine.core_proc import (
    STOP_SIGNAL,
    CoreFailure,
    CoreLaunch,
    InputKind,
    OutputKind,
    StartupInfo,
    UtilityCall,
    UtilityResult,
    run_engine_core_process,
)
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pagedllm.errors import ModelLoadError, RequestError
from pagedllm.runtime_dir import make_runtime_dir

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.engine.core_client")

# Loading a large model onto a GPU can take minutes; a core that dies while starting is noticed at once.
STARTUP_TIMEOUT_S = 900.0
# How long a terminated core may take to exit before it is killed.
_TERMINATE_TIMEOUT_S = 10.0


def send_stop(process: BaseProcess) -> None:
    """Ask an engine core process to stop (it ignores SIGTERM, which the whole process group gets)."""
    if process.pid is not None and process.is_alive():
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(process.pid, STOP_SIGNAL)


class EngineDeadError(RuntimeError):
    """The engine core process is gone: no request can be served any more."""


class EngineCoreProcess:
    """The engine core's child process, started before its configuration is known.

    Its imports (torch, the engine, the torch.compile stack) take several seconds; `pagedllm serve`
    starts it first thing, so they run while the API server imports its own modules and builds the
    configuration. `launch` hands it the configuration; `stop` ends one never launched.
    """

    def __init__(self) -> None:
        # spawn, not fork: the parent may hold threads (uvicorn, tokenizers) and torch state.
        mp = multiprocessing.get_context("spawn")
        receiver, self._sender = mp.Pipe(duplex=False)
        self.process: BaseProcess = mp.Process(
            target=run_engine_core_process, args=(receiver,), name="EngineCore", daemon=True
        )
        with group_signals_held():
            self.process.start()
        receiver.close()

    def launch(
        self,
        engine_config: EngineConfig,
        input_addr: str,
        output_addr: str,
        environ: dict[str, str] | None = None,
    ) -> None:
        """Hand the process its configuration; ``environ``: variables of this core only (its devices)."""
        launch = CoreLaunch(
            engine_config, input_addr, output_addr, os.getpid(), {**os.environ, **(environ or {})}
        )
        # A few kB, within the pipe's buffer: this does not wait for the child to finish its imports.
        with contextlib.suppress(BrokenPipeError):  # a child that died is reported by its exit code
            self._sender.send(launch)
        self._sender.close()

    def stop(self) -> None:
        """End the process if it still runs; for one never launched (`STOP_SIGNAL` ends it at once). A
        launched core is stopped by `AsyncMPClient.shutdown`."""
        self._sender.close()
        send_stop(self.process)
        self.process.join()


class AsyncMPClient:
    """Talks to an EngineCore running in a child process (create it with `await AsyncMPClient.start`)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        core_process: EngineCoreProcess | None = None,
        outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        """``outputs``: a queue shared with other cores' clients (data parallelism), else its own;
        ``environ``: variables set in this core's process only."""
        self._ipc_dir = make_runtime_dir("ipc")
        input_addr = f"ipc://{os.path.join(self._ipc_dir, 'input')}"
        output_addr = f"ipc://{os.path.join(self._ipc_dir, 'output')}"
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._dead_error: EngineDeadError | None = None
        self._closed = False
        # Set by terminate(): the core was asked to stop, its exit is no death.
        self._terminating = False
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = (
            asyncio.Queue() if outputs is None else outputs
        )
        self._reader_task: asyncio.Task[None] | None = None
        self._utility_ids = itertools.count()
        self._utility_calls: dict[int, asyncio.Future[Any]] = {}
        self._utility_decoder = msgspec.msgpack.Decoder(UtilityResult)
        self.startup_info: StartupInfo | None = None
        core_process = core_process if core_process is not None else EngineCoreProcess()
        self.process: BaseProcess = core_process.process
        # How errors name this core: which one it is matters once there are several.
        self.name = "The engine core process"
        self._engine_index = engine_config.parallel_config.data_parallel_index
        if engine_config.parallel_config.data_parallel_size > 1:
            index = self._engine_index
            self.name = f"Engine core {index} (data parallel rank {index}, pid {self.process.pid})"
        core_process.launch(engine_config, input_addr, output_addr, environ)

    @classmethod
    async def start(
        cls,
        engine_config: EngineConfig,
        core_process: EngineCoreProcess | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ) -> AsyncMPClient:
        """Launch the core (in `core_process` if one was started early) and wait until it is ready."""
        client = cls(engine_config, core_process)
        await client.wait_started(startup_timeout)
        return client

    async def wait_started(self, startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until the launched core is ready, then start reading its outputs and watching it (the
        core is stopped if it fails to start)."""
        try:
            await self._wait_ready(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        loop = asyncio.get_running_loop()
        self._reader_task = loop.create_task(self._read_outputs())
        threading.Thread(target=self._monitor, args=(loop,), name="EngineCoreMonitor", daemon=True).start()

    # ------------------------------------------------------------------------------------ start-up
    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if await self._output.poll(200):
                kind_frame, payload = await self._output.recv_multipart()
                kind = OutputKind(kind_frame)
                if kind is OutputKind.READY:
                    self.startup_info = msgspec.msgpack.decode(payload, type=StartupInfo)
                    return
                if kind is OutputKind.FAILED:
                    failure = msgspec.msgpack.decode(payload, type=CoreFailure)
                    if failure.model_load_error:
                        raise ModelLoadError(failure.message)
                    raise RuntimeError(f"{self.name} failed to start: {failure.message}")
                raise RuntimeError(f"{self.name} sent {kind.name} before it was ready")
            if not self.process.is_alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.process.exitcode} while starting (see its log above)"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start within {timeout:.0f} s")

    # --------------------------------------------------------------------------- death detection
    def _monitor(self, loop: asyncio.AbstractEventLoop) -> None:
        # Wait on the sentinel rather than join(): shutdown() joins the child too, and it sets _closed
        # first, so the two threads do not both wait on it.
        multiprocessing.connection.wait([self.process.sentinel])
        if self._closed or self._terminating:
            return
        self.process.join(1)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        message = f"{self.name} died unexpectedly ({how})"
        with contextlib.suppress(RuntimeError):  # the loop may already be closed
            loop.call_soon_threadsafe(self._mark_dead, message)

    def _mark_dead(self, message: str) -> None:
        if self._dead_error is not None or self._closed:
            return
        logger.error("%s", message)
        self._dead_error = EngineDeadError(message)
        self._outputs.put_nowait(self._dead_error)
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(self._dead_error)
        self._utility_calls.clear()

    async def _read_outputs(self) -> None:
        while True:
            kind_frame, payload = await self._output.recv_multipart()
            kind = OutputKind(kind_frame)
            if kind is OutputKind.OUTPUTS:
                self._outputs.put_nowait(self._outputs_decoder.decode(payload))
            elif kind is OutputKind.UTILITY:
                self._resolve_utility(self._utility_decoder.decode(payload))
            elif kind is OutputKind.FAILED:
                failure = msgspec.msgpack.decode(payload, type=CoreFailure)
                self._mark_dead(f"{self.name} failed: {failure.message}")
                return

    # ---------------------------------------------------------------------------------------- API
    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    @property
    def processes(self) -> list[BaseProcess]:
        return [self.process]

    def engine_index_of(self, request_id: str) -> int:
        """The data parallel rank of the core serving a request: this client's one core."""
        return self._engine_index

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def _ensure_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._closed:
            raise EngineDeadError("The engine core client is shut down")

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_alive()
        await self._input.send_multipart([InputKind.ADD.value, self._encoder.encode(request)])

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        # Aborting on a dead engine is a no-op: nothing is running there any more.
        if not request_ids or self._dead_error is not None or self._closed:
            return
        await self._input.send_multipart([InputKind.ABORT.value, self._encoder.encode(request_ids)])

    async def call_utility_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run an engine operation in the core (between two steps) and return its result; ValueError
        for bad arguments, RuntimeError for a failure, EngineDeadError if the core dies meanwhile."""
        self._ensure_alive()
        call = UtilityCall(next(self._utility_ids), method, list(args), kwargs)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_calls[call.call_id] = future
        try:
            await self._input.send_multipart([InputKind.UTILITY.value, self._encoder.encode(call)])
            return await future
        finally:
            self._utility_calls.pop(call.call_id, None)

    def _resolve_utility(self, result: UtilityResult) -> None:
        future = self._utility_calls.get(result.call_id)
        if future is None or future.done():  # the caller gave up (cancelled)
            return
        if result.error is None:
            future.set_result(result.result)
        else:
            error = result.error
            future.set_exception(
                RequestError(result.param, error) if result.bad_request else RuntimeError(error)
            )

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs of the core; raises EngineDeadError once the core is gone."""
        self._ensure_alive()
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            # Leave it in the queue for any other waiter.
            self._outputs.put_nowait(item)
            raise item
        return item

    def terminate(self) -> None:
        """Ask the core to stop (`STOP_SIGNAL`) without waiting for it; `shutdown` then waits. Several
        cores asked first stop together rather than one after the other."""
        if not self._closed and self.process.is_alive():
            self._terminating = True
            send_stop(self.process)

    def shutdown(self) -> None:
        """Stop the core process (`STOP_SIGNAL`, then SIGKILL if it does not exit) and release the
        sockets."""
        if self._closed:
            return
        self._closed = True
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self.process.is_alive():
            send_stop(self.process)
            self.process.join(_TERMINATE_TIMEOUT_S)
            if self.process.is_alive():
                logger.warning("The engine core did not exit within %.0f s; killing it", _TERMINATE_TIMEOUT_S)
                self.process.kill()
                self.process.join()
        self._input.close()
        self._output.close()
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
