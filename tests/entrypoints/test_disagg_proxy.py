"""Disaggregated prefill through two real servers and `pagedllm disagg-proxy` on 127.0.0.1.

The prefill server stores prompts' KV blocks (SharedStorageConnector, kv_producer); the decode server
loads them (kv_consumer). Greedy outputs through the proxy equal one server's; the decode server computes
none of the prompt's full blocks (its external prefix-cache hit counter says so); a corrupt stored block
is recomputed, with the same output. The servers require one API key and the proxy another (from
PAGEDLLM_API_KEY): it requires its own of its clients and sends the servers theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from remote_server import RemoteServer, free_port
from tiny_llm import make_tiny_llm

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
SERVER_KEY = "servers-secret"
PROXY_KEY = "proxy-secret"


def _kv_args(role: str, store: Path) -> list[str]:
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return ["--block-size", str(BLOCK_SIZE), "--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv_store")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[tuple[RemoteServer, RemoteServer]]:
    model = str(make_tiny_llm(tmp_path_factory.mktemp("disagg") / "m"))
    # Started side by side (each start-up waits mostly on imports).
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(RemoteServer, ["--model", model, "--api-key", SERVER_KEY, *_kv_args(role, store)])
            for role in ("kv_producer", "kv_consumer")
        ]
    started = [f.result() for f in starting if f.exception() is None]
    if len(started) < 2:
        for server in started:
            server.kill()
        raise next(f.exception() for f in starting if f.exception() is not None)  # type: ignore[misc]
    prefill, decode = started
    try:
        yield prefill, decode
    finally:
        decode.kill()
        prefill.kill()


@pytest.fixture(scope="module")
def proxy_url(servers: tuple[RemoteServer, RemoteServer]) -> Iterator[str]:
    prefill, decode = servers
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "disagg-proxy", "--prefill", prefill.url]
    cmd += ["--decode", decode.url, "--port", str(port), "--upstream-api-key", SERVER_KEY]
    proc = subprocess.Popen(cmd, env={**os.environ, "PAGEDLLM_API_KEY": PROXY_KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _client(url: str, key: str = SERVER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _external_hits(server: RemoteServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:external_prefix_cache_hits_total":
                return sample.value
    raise AssertionError("vllm:external_prefix_cache_hits_total is not exported")


PROMPTS = [
    "Paged attention stores keys and values in fixed-size blocks. " * 3,
    "Continuous batching mixes prefills and decodes in one step; the quick brown fox jumps. " * 2,
]


def _complete(client: openai.OpenAI, prompt: str, stream: bool = False) -> tuple[str, int]:
    model = client.models.list().data[0].id
    if stream:
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices), -1
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert out.usage is not None
    return out.choices[0].text, out.usage.prompt_tokens


def test_outputs_equal_one_server_and_decode_loads_the_prompt(
    servers: tuple[RemoteServer, RemoteServer], proxy_url: str
) -> None:
    prefill, decode = servers
    proxied = _client(proxy_url, PROXY_KEY)
    for i, prompt in enumerate(PROMPTS):
        before = _external_hits(decode)
        text, num_prompt = _complete(proxied, prompt, stream=i == 1)
        # One server alone (the prefill server, asked directly) gives the same greedy text.
        expected, num_prompt = _complete(_client(prefill.url), prompt)
        assert text == expected
        # Every full block of the prompt short of the last token came from the prefill server.
        assert _external_hits(decode) - before == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_corrupt_stored_blocks_are_recomputed(
    servers: tuple[RemoteServer, RemoteServer], proxy_url: str, store: Path
) -> None:
    prefill, decode = servers
    prompt = "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Hello, world! How are you today? " * 2
    known = set(store.rglob("*.safetensors"))
    expected, _ = _complete(_client(prefill.url), prompt)  # stores the prompt's blocks
    new = set(store.rglob("*.safetensors")) - known
    assert new
    for path in new:  # one flipped byte in each block's data
        raw = bytearray(path.read_bytes())
        raw[-7] ^= 0x5A
        path.write_bytes(bytes(raw))
    before = _external_hits(decode)
    text, _ = _complete(_client(proxy_url, PROXY_KEY), prompt)
    assert text == expected
    assert _external_hits(decode) == before  # nothing loaded: the decode server computed the prompt


def test_the_proxy_requires_the_api_key(proxy_url: str) -> None:
    # The servers' key is not the proxy's: the proxy itself refuses it (on its own, it would pass).
    with pytest.raises(openai.AuthenticationError) as info:
        _client(proxy_url, SERVER_KEY).completions.create(model="m", prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and "API key" in info.value.message
    for path in ("/v1/completions", "/v1/chat/completions"):  # no key at all
        raw = httpx.post(f"{proxy_url}{path}", json={"prompt": "hi", "messages": [], "model": "m"})
        assert raw.status_code == 401 and raw.json()["error"]["code"] == 401
    # Nothing but loopback: the proxy's default address.
    port = int(proxy_url.rsplit(":", 1)[1])
    connections = psutil.net_connections("tcp")
    [listening] = [c for c in connections if c.laddr.port == port and c.status == psutil.CONN_LISTEN]
    assert listening.laddr.ip == "127.0.0.1"
