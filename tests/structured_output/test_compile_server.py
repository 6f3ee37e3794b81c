"""The grammar compile server's processes follow the engine: none survives the engine's death (checked with
ps), a worker does not survive its server, and a compilation whose server died fails at once instead of
waiting for its deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import pytest
from tiny_llm import build_tokenizer

from pagedllm.config import StructuredOutputsConfig
from pagedllm.errors import RequestError
from pagedllm.structured_output.backends import XgrammarBackend
from pagedllm.structured_output.compile_client import CompileClient, CompileWorkerError
from pagedllm.structured_output.params import StructuredOutputsParams

# Compiles for a minute or more with xgrammar (its token-mask tables for 60,000 strings).
HUGE_ENUM = {"enum": [f"member-{i}" for i in range(60_000)]}

# An engine stand-in: compiles one grammar (which leaves an idle worker forked), says its server's pid,
# then waits to be killed.
ENGINE = """
import sys, time
from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.compile_client import CompileClient
from pagedllm.structured_output.params import StructuredOutputsParams

client = CompileClient(2, 0)
client.compile(StructuredOutputsParams(regex="[0-9]+"), StructuredOutputsConfig(backend="guidance"), lambda _: None, 60)
print(client.server_pid(), flush=True)
time.sleep(600)
"""


def _gone(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still alive (zombies count as gone) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _ps(pids: list[int]) -> str:
    if not pids:
        return ""
    return subprocess.run(
        ["ps", "-o", "pid,ppid,stat,args", "-p", ",".join(map(str, pids))], capture_output=True, text=True
    ).stdout


def test_no_compile_process_outlives_the_engine() -> None:
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True)
    try:
        line = engine.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), line
        server = psutil.Process(int(line))
        workers = server.children()
        assert server.ppid() == engine.pid and len(workers) == 1, workers
        pids = [server.pid, workers[0].pid]
        engine.send_signal(signal.SIGKILL)
        engine.wait(30)
        alive = _gone(pids, 15)
        assert not alive, _ps(alive)
    finally:
        engine.kill()
        engine.wait()


@pytest.fixture(scope="module")
def xgrammar_init() -> str:
    tokenizer = build_tokenizer()
    return XgrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).worker_init()


def test_a_worker_dies_with_its_server_and_its_compilation_fails_at_once(xgrammar_init: str) -> None:
    client = CompileClient(2, 0)
    config = StructuredOutputsConfig(backend="xgrammar")
    try:
        outcome: dict[str, Any] = {}

        def compile_huge() -> None:
            try:
                client.compile(StructuredOutputsParams(json=HUGE_ENUM), config, lambda _: xgrammar_init, 120)
            except Exception as e:
                outcome["error"] = e
            outcome["at"] = time.monotonic()

        thread = threading.Thread(target=compile_huge, daemon=True)
        thread.start()
        deadline = time.monotonic() + 300  # the server's start imports the grammar engines
        while client.server_pid() is None or not psutil.Process(client.server_pid()).children():
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.1)
        server = psutil.Process(client.server_pid())
        (worker,) = server.children()
        time.sleep(0.5)  # the job reaches the worker
        killed_at = time.monotonic()
        os.kill(server.pid, signal.SIGKILL)
        thread.join(30)
        # Failed when the server died, not at the 120 s deadline.
        assert isinstance(outcome.get("error"), CompileWorkerError), outcome
        assert outcome["at"] - killed_at < 15
        # The worker compiling for the dead server was killed with it, not left running.
        alive = _gone([worker.pid], 15)
        assert not alive, _ps(alive)
        # The next compilation starts a new server.
        assert (
            client.compile(StructuredOutputsParams(regex="[0-9]"), config, lambda _: xgrammar_init, 60)[0]
            == "xgrammar"
        )
        assert client.server_pid() not in (None, server.pid)
    finally:
        client.close()


def test_a_grammar_over_the_memory_bound_fails_and_its_worker_is_replaced(xgrammar_init: str) -> None:
    # 20,000 enum members take xgrammar ~800 MiB (and 17 s on a quiet Zen 5) to compile for the tiny
    # vocabulary; a worker may take 32 MiB more than it starts with here.
    client = CompileClient(1, 32)
    config = StructuredOutputsConfig(backend="xgrammar")

    def compile(json: Any) -> tuple[str, str]:
        return client.compile(StructuredOutputsParams(json=json), config, lambda _: xgrammar_init, 120)

    try:
        assert compile({"type": "integer"})[0] == "xgrammar"
        server = psutil.Process(client.server_pid())
        (worker,) = server.children()
        start = time.monotonic()
        with pytest.raises(RequestError) as refused:
            compile({"enum": [f"member-{i}" for i in range(20_000)]})
        message = str(refused.value)
        assert refused.value.param == "structured_outputs"
        assert message.startswith("structured_outputs.json needs more memory than a grammar compile worker")
        assert "32 MiB" in message and "PAGEDLLM_GRAMMAR_COMPILE_MEMORY_MB" in message
        # Refused at the bound, long before the deadline (or the host's memory).
        assert time.monotonic() - start < 60
        # That worker is replaced; the next grammar compiles in a fresh one, in the same server.
        assert not _gone([worker.pid], 15)
        assert compile({"type": "boolean"})[0] == "xgrammar"
        assert client.server_pid() == server.pid and [p.pid for p in server.children()] != [worker.pid]
    finally:
        client.close()
