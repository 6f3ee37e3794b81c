"""Tool calling through clients nobody here wrote, against a real server on 127.0.0.1 (the embedded
SmolLM2 with a named or "required" tool choice, so the output is held to the schema and parses): the
openai SDK's streaming helper accumulating tool-call deltas into a parsed pydantic model, langchain-openai's
`bind_tools` streaming, and instructor's TOOLS mode. The tools are pydantic models with a nested model,
whose schemas carry `$defs`/`$ref`."""

from __future__ import annotations

from typing import Any

import instructor
import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

PROMPT = "Plan a three-day trip to Paris, France."
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(pattern="^[A-Z]{2}$")


class Trip(BaseModel):
    destination: Place
    days: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def client(tool_server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=900)


def test_openai_sdk_stream_helper_accumulates_a_required_call(client: openai.OpenAI) -> None:
    """`client.chat.completions.stream` joins the deltas into the final message and parses the
    arguments into the tool's pydantic model (a strict tool: `$defs` under tool_choice "required")."""
    tool = openai.pydantic_function_tool(Trip, name="plan_trip")
    fragments: list[str] = []
    with client.chat.completions.stream(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    ) as stream:
        for event in stream:
            if event.type == "chunk":
                entries = [e for c in event.chunk.choices for e in c.delta.tool_calls or ()]
                assert len({e.index for e in entries}) == len(entries), entries  # one entry per call
                for entry in entries:
                    # OpenAI's shape: the arguments are a string in every entry, the first one included.
                    assert entry.function is not None and isinstance(entry.function.arguments, str), entry
            elif event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        completion = stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "plan_trip" and call.id
    assert isinstance(call.function.parsed_arguments, Trip)
    assert "".join(fragments) == call.function.arguments


def test_langchain_bind_tools_streaming(tool_server: RemoteServer) -> None:
    """langchain-openai's ChatOpenAI with a bound tool (named choice), streamed: the chunks add up to
    one tool call whose arguments validate."""
    llm = ChatOpenAI(
        model=MODEL_NAME,
        base_url=f"{tool_server.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=100,  # type: ignore[call-arg]
        max_retries=0,
        timeout=900,
    )
    bound = llm.bind_tools([Trip], tool_choice="Trip")
    joined: AIMessageChunk | None = None
    for chunk in bound.stream(PROMPT):
        assert isinstance(chunk, AIMessageChunk)
        joined = chunk if joined is None else joined + chunk
    assert joined is not None and not joined.invalid_tool_calls, joined
    [call] = joined.tool_calls
    assert call["name"] == "Trip" and call["id"]
    Trip.model_validate(call["args"])


def test_instructor_tools_mode_extracts_a_model(client: openai.OpenAI) -> None:
    """instructor's TOOLS mode: the model as a named tool, the call read back into it."""
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    trip = patched.chat.completions.create(
        model=MODEL_NAME, response_model=Trip, messages=MESSAGES, temperature=0, max_tokens=100, max_retries=0
    )
    assert isinstance(trip, Trip) and isinstance(trip.destination, Place)
