"""Server processes under stress: API keys, a killed engine core or worker, a SIGTERM drain, no orphans."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer, free_port
from tiny_llm import make_tiny_llm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from broken_models import make_broken_models  # noqa: E402

from pagedllm.runtime_dir import remove_stale_runtime_dirs  # noqa: E402

pytestmark = pytest.mark.slow


def test_api_key_then_engine_killed(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    server = RemoteServer(
        extra_args=["--served-model-name", "smol", "--chat-template", str(template), "--enable-log-requests"],
        env={"PAGEDLLM_API_KEY": "sekrit"},
    )
    try:
        # --chat-template (a file) replaces the model's template.
        auth = {"Authorization": "Bearer sekrit"}
        chat = httpx.post(
            f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=auth
        )
        plain = httpx.post(
            f"{server.url}/tokenize", json={"prompt": "[user] Hi", "add_special_tokens": False}, headers=auth
        )
        assert chat.json()["tokens"] == plain.json()["tokens"]
        # API key on: /v1 needs it, /health does not.
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401
        assert httpx.get(f"{server.url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["smol"]
        assert client.completions.create(model="smol", prompt="Hi", max_tokens=1).model == "smol"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
        assert 'model_name="smol"' in httpx.get(f"{server.url}/metrics").text
        assert "Received request" in server.log_text()  # --enable-log-requests

        # A long stream in flight when the engine core is killed: it ends with an error, no hang.
        outcome: dict[str, object] = {}

        def stream_long() -> None:
            try:
                stream = client.completions.create(
                    model="smol", prompt="Count:", max_tokens=400, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for _ in stream:
                    outcome["chunks"] = int(outcome.get("chunks", 0)) + 1  # type: ignore[call-overload]
                outcome["ended"] = "normally"
            except Exception as e:  # the stream breaks off with an error event
                outcome["ended"], outcome["ended_at"] = repr(e), time.monotonic()

        def full_long() -> None:
            try:
                client.completions.create(
                    model="smol", prompt="Count:", max_tokens=400, extra_body={"ignore_eos": True}
                )
                outcome["full"] = "normally"
            except openai.APIStatusError as e:
                outcome["full"], outcome["full_at"] = e.status_code, time.monotonic()

        threads = [threading.Thread(target=stream_long), threading.Thread(target=full_long)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not outcome.get("chunks") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert outcome.get("chunks"), server.log_tail()
        server.engine_process().kill()
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a request hung after the engine died"
        assert outcome["ended"] != "normally"
        assert "engine" in str(outcome["ended"]).lower()
        assert outcome["full"] == 503
        # Both failed within 5 s of the death.
        assert max(outcome["ended_at"], outcome["full_at"]) - killed_at < 5  # type: ignore[operator]
        # Then the server exits with an error status on its own (a supervisor restarts it), soon.
        assert server.wait(30) != 0
        assert time.monotonic() - killed_at < 15
        assert "The engine core died" in server.log_text()
        assert server.leftover_children() == []
    finally:
        server.kill()


def test_killed_worker_fails_requests_naming_its_rank(tmp_path: Path) -> None:
    """TP=2 under `mp`: one worker process gets SIGKILL mid-stream. The stream ends with an error naming
    that rank within 5 s, a request in flight gets a 503, /health turns 503 (then the server exits
    with an error status, as when the engine core dies), and no worker process is left behind."""
    model = make_tiny_llm(tmp_path / "tiny")
    server = RemoteServer(
        extra_args=["--model", str(model), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                    "--distributed-executor-backend", "mp"],
    )  # fmt: skip
    try:
        workers = server.worker_processes()
        assert len(workers) == 2
        body = {"model": "tiny", "prompt": "Count:", "max_tokens": 500, "ignore_eos": True}
        outcome: dict[str, Any] = {"chunks": 0}
        health: list[int | None] = []
        killed = threading.Event()

        def stream_long() -> None:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        outcome["error"], outcome["error_at"] = event["error"], time.monotonic()
                    else:
                        outcome["chunks"] += 1

        def full_long() -> None:
            outcome["full"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code

        def poll_health() -> None:
            with httpx.Client(timeout=10) as client:
                while True:
                    try:
                        health.append(client.get(f"{server.url}/health").status_code)
                    except httpx.HTTPError:  # the server went away
                        health.append(None)
                        if killed.is_set():
                            return
                    time.sleep(0.01)

        threads = [threading.Thread(target=f) for f in (stream_long, full_long)]
        poller = threading.Thread(target=poll_health, daemon=True)
        for thread in (*threads, poller):
            thread.start()
        deadline = time.monotonic() + 60
        while not outcome["chunks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outcome["chunks"], server.log_tail()
        victim = workers[1]
        victim.kill()
        killed_at = time.monotonic()
        killed.set()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a request hung after a worker died"
        assert outcome["error_at"] - killed_at < 5
        assert outcome["error"]["code"] == 503
        assert f"worker rank 1 (pid {victim.pid}) died" in outcome["error"]["message"]
        assert outcome["full"] == 503
        assert server.wait(30) != 0
        poller.join(10)
        # Healthy before the death; unhealthy after it, until the server stops answering.
        first_bad = health.index(503)
        assert all(code == 200 for code in health[:first_bad])
        assert all(code in (503, None) for code in health[first_bad:])
        assert server.leftover_children() == []
    finally:
        server.kill()


def test_sigterm_to_the_process_group_drains_requests_in_flight(tmp_path: Path) -> None:
    """SIGTERM to the server's whole process group (systemd's KillMode=control-group, docker stop): the
    engine core and its tensor-parallel workers ignore it, the server drains the request in flight and
    then stops them, and exits with 0 (the core died first and the request failed before)."""
    model = make_tiny_llm(tmp_path / "tiny")
    server = RemoteServer(
        extra_args=[
            "--model", str(model), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "mp", "--shutdown-timeout", "120", "--api-key", "flag-key",
            "--enable-log-requests", "--disable-log-requests",
        ]
    )  # fmt: skip
    try:
        children = [server.engine_process(), *server.worker_processes()]
        assert len(children) == 3
        result: dict[str, object] = {}
        auth = {"Authorization": "Bearer flag-key"}
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers=auth).status_code == 200
        # -tp 2 on one machine: nothing the server, the core or the workers listen on is reachable from
        # another host (the ranks meet through a file store, not a TCP store on every interface).
        listening = [
            c.laddr
            for p in [server.psutil_proc, *children]
            for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening

        def long_request() -> None:
            body = {"model": "tiny", "prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=120)
            result["status"] = response.status_code
            result["body"] = response.json()

        thread = threading.Thread(target=long_request)
        thread.start()
        # Wait until the engine runs it, then ask the server to stop.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            if 'vllm:num_requests_running{model_name="tiny"} 1.0' in metrics:
                break
            time.sleep(0.05)
        server.send_group_signal(signal.SIGTERM)
        # Draining: the listening socket is closed, so new connections are refused.
        refused = False
        deadline = time.monotonic() + 30
        while not refused and time.monotonic() < deadline:
            try:
                httpx.get(f"{server.url}/health", timeout=5)
                time.sleep(0.05)
            except httpx.ConnectError:
                refused = True
        assert refused
        # The engine core and the workers got the signal too, and run on.
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)
        thread.join(180)
        assert result.get("status") == 200, (result, server.log_tail())
        assert result["body"]["usage"]["completion_tokens"] == 200  # type: ignore[index]
        assert server.wait(60) == 0, server.log_tail()
        assert server.leftover_children() == []
        log = server.log_text()
        assert "Received request" not in log  # --disable-log-requests wins
        assert "Traceback" not in log and "died" not in log and "leaked semaphore" not in log, log[-4000:]
    finally:
        server.kill()


def test_no_orphans_when_stopped_while_starting_or_killed(tmp_path: Path) -> None:
    # SIGTERM to the process group while the engine core is still loading: the core ignores it, the
    # server exits with 0 and takes the core along.
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *SERVER_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            "spawn_main" in " ".join(p.cmdline()) for p in parent.children()
        ):
            time.sleep(0.05)
        children = parent.children(recursive=True)
        assert children
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=15)
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    # kill -9 of the API server cannot run any clean-up: the engine core notices its parent is gone, and
    # its workers die with it.
    model = make_tiny_llm(tmp_path / "tiny")
    server = RemoteServer(
        extra_args=[
            "--model",
            str(model),
            "--tensor-parallel-size",
            "2",
            "--distributed-executor-backend",
            "mp",
        ]
    )
    try:
        assert len(server.worker_processes()) == 2
        server.proc.kill()
        server.proc.wait(10)
        assert server.leftover_children() == []
        # Its socket directory stays behind; the next start (any new runtime directory) removes it.
        left = list(Path(tempfile.gettempdir()).glob(f"pagedllm-{server.proc.pid}-ipc-*"))
        assert left
        remove_stale_runtime_dirs()
        assert not any(path.exists() for path in left)
    finally:
        server.kill()


def test_bad_chat_template_flag_fails_before_loading_the_model(tmp_path: Path) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{% for %}")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(free_port())]
    result = subprocess.run(
        [*cmd, *SERVER_ARGS, "--chat-template", str(template)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--chat-template is not a valid Jinja template" in result.stderr
    assert "engine core" not in result.stderr.lower()


def test_broken_model_is_one_error_line_and_exit_1(tmp_path: Path) -> None:
    """A config.json whose shapes disagree with the weights, found by the tensor-parallel workers of the
    engine core: one line naming the checkpoint and the tensor, exit 1 (it was a RuntimeError wrapping
    the worker's traceback, after the core's own), and no process left."""
    path, named = make_broken_models(tmp_path)["shape-mismatch"]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(free_port())]
    args = ["--model", str(path), "--max-model-len", "128", "--tensor-parallel-size", "2"]
    proc = subprocess.Popen(
        [*cmd, *args, "--distributed-executor-backend", "mp"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(errors) == 1 and errors[0].startswith("pagedllm serve: error: "), output
    assert all(words in errors[0] for words in named), errors[0]
    # Nothing of the server's is left: its process group empties (the workers and multiprocessing's
    # resource tracker follow the engine core within moments).
    left = [p for p in psutil.process_iter() if _pgid(p) == proc.pid]
    _, alive = psutil.wait_procs(left, timeout=15)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def _pgid(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except ProcessLookupError:
        return None
