"""Clients nobody here wrote, against a real server: the official openai SDK (sync, async, streaming,
structured outputs with `chat.completions.parse`), instructor extracting a pydantic model, and
langchain-openai's `with_structured_output`. (Their tool-calling variants are in openai/.)"""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel, Field
from remote_server import MODEL_NAME, RemoteServer

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
