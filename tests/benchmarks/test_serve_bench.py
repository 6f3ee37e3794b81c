"""`bench serve` against a minimal OpenAI-compatible server that is not pagedllm, and its default
invocation against a tiny-model pagedllm server."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.benchmarks.datasets import SampleRequest
from pagedllm.benchmarks.serve import run_serve_benchmark, summarize
from pagedllm.entrypoints.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from remote_server import RemoteServer  # noqa: E402


def _fake_server() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body["model"] != "fake":
            return JSONResponse({"error": {"message": "unknown model"}}, status_code=404)
        n = body["max_tokens"]

        async def events():
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _serve_in_thread(app: FastAPI) -> tuple[uvicorn.Server, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.05)
    return server, port


def test_serve_benchmark_against_foreign_server():
    server, port = _serve_in_thread(_fake_server())
    try:
        reqs = [
            SampleRequest(output_len=5 + i, messages=[{"role": "user", "content": "hi"}]) for i in range(6)
        ]
        results, duration = asyncio.run(
            run_serve_benchmark(
                f"http://127.0.0.1:{port}", "fake", reqs, max_concurrency=3, request_rate=50.0
            )
        )
        assert all(r.ok for r in results), [r.error for r in results]
        assert [r.output_tokens for r in results] == [5 + i for i in range(6)]
        assert all(len(r.itl) == r.output_tokens - 1 and r.ttft > 0 for r in results)
        summary = summarize(results, duration)
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["total_output_tokens"] == sum(5 + i for i in range(6))
        assert summary["total_input_tokens"] == 3 * 6
        assert summary["p50_ttft_ms"] <= summary["p99_ttft_ms"]

        bad, _ = asyncio.run(run_serve_benchmark(f"http://127.0.0.1:{port}", "other", reqs[:1]))
        assert not bad[0].ok and "HTTP 404" in bad[0].error
    finally:
        server.should_exit = True


@pytest.mark.slow
def test_default_invocation_against_a_tiny_model_server(tmp_path: Path) -> None:
    """`bench serve --model M` and nothing else (but the server's port): random token-id prompts go to
    the completions endpoint, drawn from the served model's own vocabulary (M is its path)."""
    from tiny_llm import make_tiny_llm

    model = make_tiny_llm(tmp_path / "tiny")
    server = RemoteServer(extra_args=["--model", str(model)])
    try:
        out = tmp_path / "serve.json"
        result = subprocess.run(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", server.url]
            + ["--model", str(model), "--output-json", str(out)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        report = json.loads(out.read_text())
        # The defaults: 32 prompts of 128 tokens, up to 128 tokens each, every one served.
        assert report["completed"] == 32 and report["failed"] == 0
        assert report["total_input_tokens"] == 32 * 128
        assert 32 <= report["total_output_tokens"] <= 32 * 128
    finally:
        server.kill()


def test_random_prompts_to_the_chat_endpoint_are_refused_before_any_request() -> None:
    with pytest.raises(ValueError, match="--dataset random sends token-id prompts"):
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--endpoint", "/v1/chat/completions"])
