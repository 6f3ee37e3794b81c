"""The engine core's memory under a steady load: rounds of the same mixed requests leave its resident
size where the first round left it (issue 38: it grew by hundreds of MiB a round and had not levelled
off, from torch's oneDNN kernel caches, one entry per GEMM shape: `CpuPlatform.bound_kernel_caches`)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from remote_server import RemoteServer
from tiny_llm import make_tiny_llm

pytestmark = pytest.mark.slow

ROUNDS = 3
REQUESTS_PER_ROUND = 40
CONCURRENCY = 16
# Small enough that the warm-up's tokens pass through every block of the pool, so later rounds do not
# page in fresh KV memory (the pool is mmap'd and costs RAM only once touched).
KV_POOL = "4M"
WORDS = "the quick brown fox jumps over a lazy dog while paged attention stores keys and values".split()


def _mixed_request(index: int) -> tuple[str, dict[str, Any]]:
    """Request `index` of a round: prompt lengths, output lengths, streaming, n, logprobs, stop strings,
    logit bias, penalties, shared prefixes and tokenization, the same in every round."""
    rng = random.Random(index)
    prefix = "A system prefix that many requests share. " * 4 if index % 3 == 0 else ""
    text = prefix + " ".join(rng.choice(WORDS) for _ in range(rng.choice([5, 20, 40, 80])))
    common = {"model": "tiny", "max_tokens": rng.choice([4, 16, 48]), "temperature": rng.choice([0, 0.8])}
    chat = [{"role": "user", "content": text}]
    kinds = [
        ("/v1/completions", {**common, "prompt": text, "stream": True, "ignore_eos": True}),
        ("/v1/completions", {**common, "prompt": text, "n": 2, "logprobs": 3, "seed": index}),
        ("/v1/chat/completions", {**common, "messages": chat, "logprobs": True, "top_logprobs": 2, "stream": True}),
        ("/v1/chat/completions", {**common, "messages": chat, "stop": ["fox"], "logit_bias": {"5": 3, "7": -100}}),
        ("/v1/completions", {**common, "prompt": text, "presence_penalty": 0.5, "repetition_penalty": 1.1, "top_k": 20}),
        ("/tokenize", {"model": "tiny", "prompt": text}),
    ]  # fmt: skip
    return kinds[index % len(kinds)]


def _send(url: str, index: int) -> int:
    path, body = _mixed_request(index)
    with httpx.Client(base_url=url, timeout=300) as client:
        if body.get("stream"):
            with client.stream("POST", path, json=body) as response:
                for _ in response.iter_lines():
                    pass
                return response.status_code
        return client.post(path, json=body).status_code


def test_engine_core_memory_is_flat_over_rounds_of_the_same_load(tmp_path: Path) -> None:
    model = make_tiny_llm(tmp_path / "tiny")
    server = RemoteServer(
        extra_args=["--model", str(model), "--served-model-name", "tiny", "--kv-cache-memory-bytes", KV_POOL]
    )
    try:
        engine = server.engine_process()
        # Touch the KV pool: distinct long prompts (prefill is cheap) whose tokens add up to more than it
        # holds; its blocks are handed out in LRU order, so each one is written before any is reused.
        warm = [
            {"model": "tiny", "prompt": f"{i} " + " ".join(WORDS * 13), "max_tokens": 1, "ignore_eos": True}
            for i in range(24)
        ]
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            codes = list(
                pool.map(lambda b: httpx.post(f"{server.url}/v1/completions", json=b, timeout=300), warm)
            )
        assert all(r.status_code == 200 for r in codes), codes[0].text
        resident = []
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                statuses = list(pool.map(lambda i: _send(server.url, i), range(REQUESTS_PER_ROUND)))
            assert statuses == [200] * REQUESTS_PER_ROUND
            resident.append(engine.memory_info().rss)
        # The issue asks for 5% over the run. Most of the tiny model's resident size is torch's own
        # libraries, so the last round is held tighter: there unbounded kernel caches still grew it 5-6%
        # while bounded ones had levelled off (0.3-0.6%; the first round may still page in allocator arenas).
        mib = [f"{r / 2**20:.0f} MiB" for r in resident]
        assert (resident[-1] - resident[0]) / resident[0] < 0.05, mib
        assert (resident[-1] - resident[-2]) / resident[-2] < 0.02, mib
    finally:
        server.kill()
