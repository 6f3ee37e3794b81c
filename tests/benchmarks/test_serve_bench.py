"""`bench serve` against a minimal OpenAI-compatible server that is not pagedllm."""

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.benchmarks.datasets import SampleRequest
from pagedllm.benchmarks.serve import run_serve_benchmark, summarize


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
        assert summary["p50_ttft_ms"] <= summary["p99_ttft_ms"]

        bad, _ = asyncio.run(run_serve_benchmark(f"http://127.0.0.1:{port}", "other", reqs[:1]))
        assert not bad[0].ok and "HTTP 404" in bad[0].error
    finally:
        server.should_exit = True
