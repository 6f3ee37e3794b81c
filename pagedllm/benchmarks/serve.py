"""`pagedllm bench serve`: online benchmark against any OpenAI-compatible server (pagedllm or another).

Streams every request, and measures time to first token (TTFT), inter-token latency (ITL: gaps between
streamed chunks), time per output token after the first (TPOT) and output tokens/s over the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from pagedllm.benchmarks.datasets import SampleRequest


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def _payload(req: SampleRequest, model: str, endpoint: str) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.endswith("/chat/completions"):
        if req.messages is None:
            raise ValueError("the chat endpoint needs a chat dataset (rows with 'messages')")
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt_token_ids if req.prompt_token_ids is not None else _flatten(req)
    return body


def _flatten(req: SampleRequest) -> str:
    assert req.messages is not None
    return "\n".join(m["content"] for m in req.messages)


async def _send(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]) -> RequestResult:
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                choices = event.get("choices") or []
                if not choices:
                    continue
                delta = choices[0].get("delta", {}).get("content") or choices[0].get("text")
                if not delta:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def run_serve_benchmark(
    base_url: str,
    model: str,
    requests: list[SampleRequest],
    endpoint: str = "/v1/chat/completions",
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    api_key: str | None = None,
    ignore_eos: bool = False,
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    rng = random.Random(seed)
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests))

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(req: SampleRequest) -> RequestResult:
            body = _payload(req, model, endpoint)
            if ignore_eos:
                # vLLM's extension field (pagedllm and vLLM honour it); only sent when asked for, since
                # other servers may reject unknown fields.
                body["ignore_eos"] = True
            async with limit:
                return await _send(client, url, body, headers)

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if request_rate != float("inf"):
                # Poisson arrivals at the requested rate.
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, float] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        # As the server counted them (its usage), as vLLM's bench serve reports them.
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
    }
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", [r.latency for r in ok])):
        if values:
            arr = np.asarray(values) * 1000.0
            summary[f"mean_{name}_ms"] = float(arr.mean())
            for p in (50, 90, 99):
                summary[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return summary


_SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


def spec_decode_counters(base_url: str) -> tuple[float, float] | None:
    """(drafts, accepted tokens) summed over the server's /metrics; None when it reports no speculative
    decoding (no drafter configured, or a server without these metrics)."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30.0).text
    except httpx.HTTPError:
        return None
    totals = dict.fromkeys(_SPEC_COUNTERS, 0.0)
    found = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            found = True
    return (totals[_SPEC_COUNTERS[0]], totals[_SPEC_COUNTERS[1]]) if found else None


def mean_acceptance_length(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Tokens emitted per verification between two readings of `spec_decode_counters` (vLLM's figure)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 1 + (after[1] - before[1]) / (after[0] - before[0])
