"""`pagedllm serve --data-parallel-size 2` (two engine cores behind one server) and the external-LB mode
(one rank per server), against the offline engine (one core, no data parallelism) on a tiny Llama."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from remote_server import RemoteServer
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "optimization_level": 0}
PROMPTS = [[5 + i, 17, 40 + 3 * i, 9, 33, 60 + i] for i in range(6)]
# Seeded sampling (temperature > 0) for most prompts, greedy for two.
BODIES = [
    {"temperature": 0.0} if i in (1, 4) else {"temperature": 1.0, "top_p": 0.9, "seed": 100 + i}
    for i in range(len(PROMPTS))
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[str]:
    """The texts of one engine core without data parallelism (the offline engine)."""
    llm = LLM(model=str(model_dir), enforce_eager=True, **ENGINE_ARGS)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **body)  # type: ignore[arg-type]
        for body in BODIES
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].text for o in outputs]


def _server(model_dir: Path, *flags: str) -> RemoteServer:
    return RemoteServer(extra_args=["--model", str(model_dir), "--dtype", "float32", *flags])


@pytest.fixture(scope="module")
def dp_server(model_dir: Path) -> Iterator[RemoteServer]:
    server = _server(model_dir, "--data-parallel-size", "2")
    try:
        yield server
    finally:
        server.kill()


def _engine_cores(server: RemoteServer) -> list[psutil.Process]:
    # multiprocessing's spawn children (its resource tracker is another child, started differently).
    return [p for p in server.children if p.is_running() and "spawn_main" in " ".join(p.cmdline())]


def _complete(server: RemoteServer, model_dir: Path, index: int) -> str:
    body = {
        "model": str(model_dir), "prompt": PROMPTS[index], "max_tokens": MAX_TOKENS, "ignore_eos": True,
        **BODIES[index],
    }  # fmt: skip
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def _complete_all(server: RemoteServer, model_dir: Path) -> list[str]:
    """Every prompt at once, so that both cores get some."""
    texts: dict[int, str] = {}
    start = threading.Barrier(len(PROMPTS))

    def run(index: int) -> None:
        start.wait(30)
        texts[index] = _complete(server, model_dir, index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [texts.get(i, "<no answer>") for i in range(len(PROMPTS))]


def _successes_by_engine(server: RemoteServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    counts: dict[str, float] = {}
    for engine, value in re.findall(
        r'^vllm:request_success_total\{engine="(\d+)",[^}]*\} (\S+)$', text, re.M
    ):
        counts[engine] = counts.get(engine, 0.0) + float(value)
    return counts


def test_requests_spread_over_both_cores_with_the_outputs_of_one(
    dp_server: RemoteServer, model_dir: Path, reference: list[str]
) -> None:
    assert len(_engine_cores(dp_server)) == 2
    assert _complete_all(dp_server, model_dir) == reference
    counts = _successes_by_engine(dp_server)
    # Each core counts its own successes. Which core served which prompt depends on whether the prompts
    # overlapped: on a quiet machine the tiny model finishes each before the next arrives, and the
    # least-loaded choice (tests/engine/test_dp_client.py) then picks core 0 every time.
    assert set(counts) <= {"0", "1"} and sum(counts.values()) == len(PROMPTS), counts
    # Both cores' gauges are exposed too, each under its engine label.
    metrics = httpx.get(f"{dp_server.url}/metrics").text
    for engine in ("0", "1"):
        assert re.search(rf'^vllm:num_requests_running\{{engine="{engine}",', metrics, re.M)


def test_a_killed_core_fails_requests_with_its_name_and_stops_the_server(
    dp_server: RemoteServer, model_dir: Path
) -> None:
    outcomes: dict[int, Any] = {}
    failed_at: dict[int, float] = {}
    chunks = [0] * 4

    def stream(index: int) -> None:
        body = {"model": str(model_dir), "prompt": PROMPTS[index], "max_tokens": 480, "ignore_eos": True}
        try:
            with httpx.stream(
                "POST", f"{dp_server.url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as response:
                for line in response.iter_lines():
                    chunks[index] += 1
                    if "error" in line:
                        outcomes[index], failed_at[index] = line, time.monotonic()
                        return
            outcomes[index] = "ended normally"
        except httpx.HTTPError as e:
            outcomes[index] = repr(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not all(chunks) and time.monotonic() < deadline:
        time.sleep(0.02)
    # Rank 0 is the process `serve` starts first (before it parses its flags), rank 1 the next.
    core_one = sorted(_engine_cores(dp_server), key=lambda p: p.create_time())[1]
    core_one.kill()
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "a request hung after a core died"
    errors = [str(o) for o in outcomes.values() if o != "ended normally"]
    assert errors, outcomes
    # The requests on the dead core failed within 5 s of its death.
    assert max(failed_at.values()) - killed_at < 5, (failed_at, killed_at)
    assert all("Engine core 1 (data parallel rank 1" in e for e in errors), errors
    # The engine is dead: /health says so until the server is gone, then nothing answers.
    try:
        assert httpx.get(f"{dp_server.url}/health", timeout=5).status_code == 503
    except httpx.TransportError:  # the server is already gone
        pass
    assert dp_server.wait(30) != 0
    assert "The engine core died" in dp_server.log_text()
    assert dp_server.leftover_children() == []


def test_external_lb_runs_one_rank(model_dir: Path, reference: list[str]) -> None:
    server = _server(
        model_dir, "--data-parallel-size", "2", "--data-parallel-rank", "1", "--data-parallel-external-lb"
    )
    try:
        assert len(_engine_cores(server)) == 1
        # The rank seeds nothing differently: the same outputs as any other core.
        assert [_complete(server, model_dir, i) for i in range(len(PROMPTS))] == reference
        assert _successes_by_engine(server) == {"1": float(len(PROMPTS))}
    finally:
        server.kill()
    assert server.leftover_children() == []
