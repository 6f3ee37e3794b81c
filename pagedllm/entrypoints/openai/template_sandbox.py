"""The process that renders chat templates sent in requests (`--trust-request-chat-template`).

A request's template is code the server did not choose. transformers renders it in jinja2's
`ImmutableSandboxedEnvironment`, which keeps it away from Python's internals but bounds neither its time
nor its memory: `{{'x'*200000000}}` is a few bytes that allocate gigabytes, and nested loops run for
minutes.
No thread can be stopped from outside, and one string operation can exhaust memory before any check
between two steps runs, so the rendering happens in a child process of its own:
- under an address-space limit (`MEMORY_LIMIT_BYTES`): an allocation beyond it is a MemoryError there;
- killed at `TIMEOUT_S` (and started again for the next template);
- its text refused past `MAX_RENDERED_CHARS`.
The child is `python -m pagedllm.entrypoints.openai.template_sandbox` (it imports jinja2 and transformers'
renderer only, not torch), and jobs and answers cross its stdin and stdout as length-prefixed msgspec
messages: the process that runs the untrusted template never sends the server a pickle. One template
renders at a time; waiting happens on the event loop, not in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import BinaryIO

import msgspec

from pagedllm.chat_template import ChatRender, describe_render_error
from pagedllm.errors import RequestError

TIMEOUT_S = 5.0
# Far beyond any prompt a context holds (a 128k-token context is ~0.5 MB of text).
MAX_RENDERED_CHARS = 8 * 2**20
# The interpreter with jinja2 and transformers' renderer maps ~0.2 GiB; the rest is the template's.
MEMORY_LIMIT_BYTES = 2 * 2**30
# The child's imports (jinja2, transformers' renderer) on a loaded machine.
STARTUP_TIMEOUT_S = 120.0
_READY = b"ready"
_LENGTH = struct.Struct("<Q")


class _Answer(msgspec.Struct, array_like=True, omit_defaults=True):
    text: str | None = None
    param: str | None = None
    message: str = ""


def _render(job: ChatRender) -> _Answer:
    try:
        text = job.render()
    except MemoryError:
        return _Answer(param="chat_template", message=_memory_message())
    except Exception as e:  # the template's or the messages' fault, as for any template
        param, message = describe_render_error(e)
        return _Answer(param=param, message=message)
    if len(text) > MAX_RENDERED_CHARS:
        return _Answer(
            param="chat_template",
            message=f"chat_template rendered {len(text)} characters, more than the limit of {MAX_RENDERED_CHARS}",
        )
    return _Answer(text=text)


def _memory_message() -> str:
    return f"chat_template needed more than {MEMORY_LIMIT_BYTES >> 20} MiB of memory to render"


def _write_frame(out: BinaryIO, payload: bytes) -> None:
    out.write(_LENGTH.pack(len(payload)) + payload)
    out.flush()


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) != size:
        raise EOFError("the other end closed the pipe")
    return data


def serve_renders(jobs: BinaryIO, answers: BinaryIO) -> None:
    """The child process: say it is ready (its imports are done), then render each job until the server
    closes `jobs`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    decoder, encoder = msgspec.msgpack.Decoder(ChatRender), msgspec.msgpack.Encoder()
    _write_frame(answers, _READY)
    while True:
        try:
            (size,) = _LENGTH.unpack(_read_exactly(jobs, _LENGTH.size))
            job = decoder.decode(_read_exactly(jobs, size))
        except EOFError:  # the server is gone
            return
        answer = _render(job)
        del job
        try:
            payload = encoder.encode(answer)
        except MemoryError:
            payload = encoder.encode(_Answer(param="chat_template", message=_memory_message()))
        _write_frame(answers, payload)


class TemplateSandbox:
    """The rendering process: started by `start()` (its imports take seconds, so the server starts it
    with itself), and again at once after it was killed."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = False
        # Requests queue on the event loop; the thread lock also covers a render whose request was
        # cancelled while its thread still talks to the process.
        self._turn = asyncio.Lock()
        self._lock = threading.Lock()
        self._decoder = msgspec.msgpack.Decoder(_Answer)
        self._encoder = msgspec.msgpack.Encoder()

    def start(self) -> None:
        """Start the process if it is not running (returns at once; it gets ready in the background)."""
        if self._process is not None and self._process.poll() is None:
            return
        self._stop()
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        self._ready = False

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.kill()
        process.wait(5)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()

    def _read_frame(self, deadline: float) -> bytes | None:
        """The next frame from the process, None if it does not come by `deadline` (EOFError if the
        process is gone)."""
        assert self._process is not None and self._process.stdout is not None
        fd, data = self._process.stdout.fileno(), b""
        needed = _LENGTH.size
        while len(data) < needed:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, max(needed - len(data), 1 << 16))
            if not chunk:
                raise EOFError("the template sandbox process exited")
            data += chunk
            if needed == _LENGTH.size and len(data) >= needed:
                needed += _LENGTH.unpack(data[: _LENGTH.size])[0]
        return data[_LENGTH.size :]

    def _wait_ready(self) -> subprocess.Popen[bytes]:
        self.start()
        assert self._process is not None
        if not self._ready:
            try:
                frame = self._read_frame(time.monotonic() + STARTUP_TIMEOUT_S)
            except EOFError:
                frame = None
            if frame != _READY:
                self._stop()
                raise RuntimeError(
                    f"the chat template sandbox process did not start in {STARTUP_TIMEOUT_S:g} s"
                )
            self._ready = True
        return self._process

    def _render_blocking(self, job: ChatRender) -> str:
        with self._lock:
            process = self._wait_ready()
            assert process.stdin is not None
            try:
                _write_frame(process.stdin, self._encoder.encode(job))
                frame = self._read_frame(time.monotonic() + self.timeout_s)
            except (EOFError, OSError):  # killed by the kernel (memory) or crashed
                self._stop()
                self.start()
                raise RequestError("chat_template", _memory_message()) from None
            if frame is None:
                self._stop()
                self.start()  # the next one gets ready meanwhile
                raise RequestError(
                    "chat_template", f"chat_template took longer than {self.timeout_s:g} s to render"
                )
        answer = self._decoder.decode(frame)
        if answer.text is None:
            raise RequestError(answer.param, answer.message)
        return answer.text

    async def render(self, job: ChatRender) -> str:
        """The rendered text (RequestError naming the field at fault); one render at a time."""
        async with self._turn:
            return await asyncio.to_thread(self._render_blocking, job)

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            self._stop()


if __name__ == "__main__":
    # Frames go to the server on the real stdout; anything else printed goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve_renders(sys.stdin.buffer, answers)
