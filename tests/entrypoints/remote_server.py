"""A real `pagedllm serve` process on 127.0.0.1 for the server tests (always killed in teardown)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

# Small and fast: a short context, few sequences' worth of KV cache, no compilation.
SERVER_ARGS = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "64",
    "--kv-cache-memory-bytes",
    "256M",
    "-O0",
    "--uvicorn-log-level",
    "warning",
]
MODEL_NAME = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def on_one_connection(
    url: str, requests: list[tuple[str, str, Any]], headers: dict[str, str] | None = None
) -> list[tuple[int, Any]]:
    """Send ``(method, path, JSON body or None)`` requests one after the other over one keep-alive HTTP/1.1
    connection, and return each status with its JSON body (None if not JSON). http.client never
    reconnects by itself: a connection the server closed after an answer fails the next request."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    results: list[tuple[int, Any]] = []
    try:
        for method, path, body in requests:
            data = None if body is None else json.dumps(body)
            conn.request(
                method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
            )
            response = conn.getresponse()
            raw = response.read()
            try:
                results.append((response.status, json.loads(raw)))
            except ValueError:
                results.append((response.status, None))
    finally:
        conn.close()
    return results


class RemoteServer:
    """`python -m pagedllm.entrypoints.cli serve ...` in its own session, with its log in a temp file."""

    def __init__(self, extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="pagedllm-server-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--port",
            str(self.port),
            *SERVER_ARGS,
            *(extra_args or []),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.psutil_proc = psutil.Process(self.proc.pid)
        self.children: list[psutil.Process] = []
        self._wait_healthy()
        # The engine core process, known now that the server answers.
        self.children = self.psutil_proc.children(recursive=True)

    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.kill()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = self.log_tail()
        self.kill()
        raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{tail}")

    def engine_process(self) -> psutil.Process:
        # multiprocessing's spawn child (its resource tracker is another child, started differently).
        [engine] = [p for p in self._spawned() if p.ppid() == self.proc.pid]
        return engine

    def worker_processes(self) -> list[psutil.Process]:
        """The engine core's worker processes (the `mp` executor), in the order they started."""
        engine = self.engine_process()
        workers = [p for p in self._spawned() if p.ppid() == engine.pid]
        return sorted(workers, key=lambda p: (p.create_time(), p.pid))

    def _spawned(self) -> list[psutil.Process]:
        return [p for p in self.children if p.is_running() and "spawn_main" in " ".join(p.cmdline())]

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def send_group_signal(self, sig: int) -> None:
        """To the server and every process it started, as systemd, `docker stop` or Ctrl-C do."""
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Stop the server and everything it started, whatever state it is in."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for child in self.children:
            if child.is_running():
                child.kill()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def leftover_children(self, timeout: float = 15.0) -> list[psutil.Process]:
        """Processes the server started that are still alive (after waiting up to ``timeout``)."""
        _, alive = psutil.wait_procs([c for c in self.children if c.is_running()], timeout=timeout)
        return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
