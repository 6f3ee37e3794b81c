"""The EngineCore in its own process: a busy loop fed by an input I/O thread, drained by an output thread.

The API server process must never run the model, so the core lives in a child process and talks to the
front-end (`pagedllm.engine.core_client.AsyncMPClient`) over two ZMQ PUSH/PULL sockets with
msgspec-encoded messages. Decoding and encoding happen on the I/O threads (msgspec and ZMQ release the
GIL), so the busy loop only calls `EngineCore`.

Wire format, one multipart message per item: ``[kind, payload]``.
- front-end -> core: ``ADD`` + EngineCoreRequest, ``ABORT`` + list of request ids, ``UTILITY`` +
  UtilityCall (an engine operation by name: sleep, weight updates, profiling, worker RPCs).
- core -> front-end: ``READY`` + StartupInfo once the core is built, ``OUTPUTS`` + EngineCoreOutputs,
  ``UTILITY`` + UtilityResult (the call's answer, or its error), ``FAILED`` + CoreFailure when the
  core could not start or crashed (the process then exits).
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
import os
import queue
import signal
import threading
import traceback
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import zmq

from pagedllm.child_process import init_child_process
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.errors import ErrorReport, ModelLoadError

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection

    from pagedllm.config import EngineConfig
    from pagedllm.engine.core import EngineCore

logger = logging.getLogger("pagedllm.engine.core_proc")

# How often an idle core wakes up to check for shutdown and for a dead parent (seconds).
_IDLE_POLL_S = 0.2
# How a front-end stops its core: SIGTERM and SIGINT go to the whole process group, and the core ignores
# them (`pagedllm.child_process`).
STOP_SIGNAL = signal.SIGUSR1


class InputKind(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    # Never sent by the front-end: queued in the core when a grammar finishes compiling, to wake its loop.
    WAKE = b"\x03"


class OutputKind(bytes, enum.Enum):
    OUTPUTS = b"\x00"
    READY = b"\x01"
    FAILED = b"\x02"
    UTILITY = b"\x03"


class UtilityCall(msgspec.Struct):
    """An engine operation by name (`pagedllm.engine.utility.UTILITY_METHODS`), run between steps."""

    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class UtilityResult(msgspec.Struct):
    call_id: int
    result: Any = None
    error: str | None = None
    """`"<ExceptionType>: <message>"` when the call raised."""
    bad_request: bool = False
    """Whether it raised ValueError (bad arguments, a refused update): the caller's fault."""
    param: str | None = None
    """The argument at fault, when the call raised a RequestError naming one."""


class CoreFailure(msgspec.Struct):
    """Why the core could not start, or stopped serving."""

    message: str
    model_load_error: bool = False
    """The model's files are at fault (a `ModelLoadError`): the front-end raises it again, and the CLI
    prints its message as one line instead of a traceback."""

    @classmethod
    def of(cls, error: Exception) -> CoreFailure:
        if isinstance(error, ModelLoadError):
            return cls(str(error), model_load_error=True)
        return cls(f"{type(error).__name__}: {error}")


class StartupInfo(msgspec.Struct):
    """What the core reports once it is built (the KV cache is sized in this process)."""

    pid: int
    num_gpu_blocks: int | None


class _Shutdown(Exception):
    """Raised in the busy loop by `STOP_SIGNAL`, or when the parent process is gone."""


class EngineCoreProc:
    """Runs one EngineCore with an input thread, an output thread and a busy loop on the main thread."""

    def __init__(self, core: EngineCore, input_addr: str, output_addr: str, parent_pid: int) -> None:
        self.core = core
        self.parent_pid = parent_pid
        # Tags every output, so a front-end over several cores (data parallelism) knows the sender.
        self.engine_index = core.engine_config.parallel_config.data_parallel_index
        self.input_queue: queue.Queue[tuple[InputKind, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[OutputKind, Any] | None] = queue.Queue()
        self._stop = threading.Event()
        # Whether the last stats sent described a busy core: once idle, one more stats message goes out
        # so that the front-end's gauges (running, KV usage) return to their idle values.
        self._sent_busy_stats = False
        # Utility calls waiting for the running requests to finish (`EngineCore.defers`), kept in order:
        # any call behind a deferred one waits too.
        self._deferred: list[UtilityCall] = []
        self._ctx = zmq.Context()
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_addr,), name="EngineCoreInput", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, args=(output_addr,), name="EngineCoreOutput", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()
        if core.structured_output_manager is not None:
            core.structured_output_manager.add_ready_listener(self._wake)

    # ----------------------------------------------------------------------------------- I/O threads
    def _input_loop(self, addr: str) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
        try:
            while not self._stop.is_set():
                if not sock.poll(int(_IDLE_POLL_S * 1000)):
                    continue
                kind_frame, payload = sock.recv_multipart(copy=False)
                kind = InputKind(kind_frame.bytes)
                if kind is InputKind.ADD:
                    self.input_queue.put((kind, add_decoder.decode(payload.buffer)))
                elif kind is InputKind.UTILITY:
                    self.input_queue.put((kind, utility_decoder.decode(payload.buffer)))
                else:
                    self.input_queue.put((kind, abort_decoder.decode(payload.buffer)))
        finally:
            sock.close()

    def _output_loop(self, addr: str) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        # Give the last messages (FAILED, final outputs) a moment to leave at shutdown.
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(addr)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                item = self.output_queue.get()
                if item is None:
                    break
                kind, message = item
                sock.send_multipart([kind.value, encoder.encode(message)], copy=False)
        finally:
            sock.close()

    # ------------------------------------------------------------------------------------- busy loop
    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _check_alive(self) -> None:
        # A parent killed with SIGKILL cannot stop us: notice it, or the core would be orphaned.
        if os.getppid() != self.parent_pid:
            logger.warning("Parent process %d is gone; engine core exiting.", self.parent_pid)
            raise _Shutdown

    def _wake(self) -> None:
        self.input_queue.put((InputKind.WAKE, None))

    def _process_input_queue(self) -> None:
        self._check_alive()
        if not self.core.has_unfinished_requests():
            self._send_idle_stats()
            while True:
                try:
                    item = self.input_queue.get(timeout=_IDLE_POLL_S)
                    break
                except queue.Empty:
                    self._check_alive()
            self._handle(item)
        elif self.core.waiting_for_grammars():
            # Nothing can run until a grammar compiles: sleep until one does (`_wake`), a request
            # arrives, or the poll interval passes, rather than stepping back to back. The front-end
            # learns that these requests wait (vLLM's num_requests_waiting counts them).
            self._send_stats()
            try:
                self._handle(self.input_queue.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: tuple[InputKind, Any]) -> None:
        kind, message = item
        if kind is InputKind.WAKE:
            return
        if kind is InputKind.ADD:
            # EngineCore reports a refused request in the next step's `errors`; it never raises here.
            self.core.add_request(message)
        elif kind is InputKind.UTILITY:
            if self._deferred or self.core.defers(message.method):
                self._deferred.append(message)
            else:
                self.output_queue.put((OutputKind.UTILITY, self._run_utility(message)))
        else:
            self.core.abort_requests(message)

    def _run_utility(self, call: UtilityCall) -> UtilityResult:
        # Any failure goes back to the caller: an operation must never take the engine down.
        try:
            result = self.core.call_utility(call.method, call.args, call.kwargs)
            # Encoded here, not on the output thread: a result msgpack cannot carry becomes an error.
            return UtilityResult(call.call_id, result=msgspec.to_builtins(result))
        except _Shutdown:  # stopped during a long call (a weight transfer waiting for its trainer)
            raise
        except Exception as e:
            bad_request = isinstance(e, ValueError)
            if not bad_request:
                logger.exception("engine utility %s failed", call.method)
            report = ErrorReport.of(e)
            return UtilityResult(
                call.call_id, error=report.message, bad_request=bad_request, param=report.param
            )

    def _process_engine_step(self) -> None:
        if self.core.has_unfinished_requests():
            outputs = self.core.step()
            outputs.engine_index = self.engine_index
            if outputs.outputs or outputs.errors or outputs.scheduler_stats is not None:
                self._sent_busy_stats = True
                self.output_queue.put((OutputKind.OUTPUTS, outputs))
        if self._deferred and not self.core.scheduler.running:
            for call in self._deferred:
                self.output_queue.put((OutputKind.UTILITY, self._run_utility(call)))
            self._deferred.clear()
            self.core.release_held_requests()

    def _send_idle_stats(self) -> None:
        if self._sent_busy_stats:
            self._send_stats()
            self._sent_busy_stats = False

    def _send_stats(self) -> None:
        stats: SchedulerStats | None = self.core.scheduler.make_stats()
        if stats is not None:  # None when the engine does not collect stats
            self._sent_busy_stats = True
            message = EngineCoreOutputs(scheduler_stats=stats, engine_index=self.engine_index)
            self.output_queue.put((OutputKind.OUTPUTS, message))

    def send_failure(self, failure: CoreFailure) -> None:
        self.output_queue.put((OutputKind.FAILED, failure))

    def shutdown(self) -> None:
        self._stop.set()
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)
        self._input_thread.join(timeout=5)
        self.core.shutdown()
        self._ctx.term()


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise _Shutdown


class CoreLaunch(NamedTuple):
    """What the front-end sends a started core process once its configuration is known."""

    engine_config: EngineConfig
    input_addr: str
    output_addr: str
    parent_pid: int
    environ: dict[str, str]
    """The front-end's environment at that point: building the configuration may have set variables
    (NCCL_GRAPH_REGISTER, PAGEDLLM_USE_BREAKABLE_CUDAGRAPH) after this process was spawned."""


def _probe_cpu_vector_isa() -> None:
    from pagedllm.platforms import current_platform

    if current_platform.is_cpu():
        # Inductor's first CPU compile probes which vector ISAs build and load (a child Python per ISA,
        # over a second in all); the answer is cached for the process.
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        valid_vec_isa_list()


# What the core will need, slowest last: the engine, transformers' model configurations (the
# configuration holds one), the torch.compile stack and Inductor's CPU probe (for the default O2).
_PRELOAD_STEPS: tuple[Callable[[], object], ...] = (
    functools.partial(importlib.import_module, "pagedllm.engine.core"),
    functools.partial(importlib.import_module, "transformers.configuration_utils"),
    functools.partial(importlib.import_module, "torch._inductor.compile_fx"),
    _probe_cpu_vector_isa,
)


def _preload(launch_conn: Connection) -> None:
    for step in _PRELOAD_STEPS:
        # Once the launch is here, waiting for a step the configuration may not need (an O0 engine
        # compiles nothing) would only delay the start; what is needed gets imported on first use.
        if launch_conn.poll():
            return
        try:
            step()
        except Exception:
            # Only a head start: whatever failed here fails again where the core needs it, and is
            # reported to the front-end from there (an engine that does not need it still starts).
            logger.debug("engine core preload step %s failed", step, exc_info=True)
            return


def run_engine_core_process(launch_conn: Connection) -> None:
    """Entry point of the engine core process (spawned by `EngineCoreProcess` before the configuration
    exists): prepare what the core will need until the `CoreLaunch` arrives, then run the core. Until
    then `STOP_SIGNAL` ends it at once (its default action)."""
    init_child_process()
    _preload(launch_conn)
    try:
        launch: CoreLaunch = launch_conn.recv()
    except EOFError:
        # The front-end gave up before configuring us (a configuration error, Ctrl-C): nothing to do.
        os._exit(0)
    launch_conn.close()
    os.environ.update(launch.environ)
    run_engine_core(launch.engine_config, launch.input_addr, launch.output_addr, launch.parent_pid)


def run_engine_core(engine_config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Build the EngineCore and serve the front-end until `STOP_SIGNAL` or the parent's death."""
    signal.signal(STOP_SIGNAL, _raise_shutdown)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [engine core] %(message)s")
    proc: EngineCoreProc | None = None
    exit_code = 0
    try:
        from pagedllm.engine.core import EngineCore

        core = EngineCore(engine_config)
        proc = EngineCoreProc(core, input_addr, output_addr, parent_pid)
        info = StartupInfo(pid=os.getpid(), num_gpu_blocks=engine_config.cache_config.num_gpu_blocks)
        proc.output_queue.put((OutputKind.READY, info))
        proc.run_busy_loop()
    except _Shutdown:
        logger.info("Engine core shutting down.")
    except Exception as e:
        # The front-end stops us once it has the failure: that must not interrupt its sending.
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)
        exit_code = 1
        failure = CoreFailure.of(e)
        if not failure.model_load_error:  # a broken model is the front-end's one line; anything else a bug
            logger.error("Engine core failed:\n%s", traceback.format_exc())
        if proc is None:
            _send_startup_failure(output_addr, failure)
        else:
            proc.send_failure(failure)
    finally:
        if proc is not None:
            # A second stop must not interrupt the clean-up.
            signal.signal(STOP_SIGNAL, signal.SIG_IGN)
            proc.shutdown()
    logging.shutdown()
    # Leave at once: no atexit handlers of libraries that may block on threads we no longer serve.
    os._exit(exit_code)


def _send_startup_failure(output_addr: str, failure: CoreFailure) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(output_addr)
    sock.send_multipart([OutputKind.FAILED.value, msgspec.msgpack.encode(failure)])
    sock.close()
    ctx.term()
