"""The Responses API (POST /v1/responses, GET /v1/responses/{id}) with the official openai client against
a real server: plain and streamed answers, instructions, conversations continued by
previous_response_id, function tools."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    # A short city name: the arguments then fit max_output_tokens whatever the tiny model writes.
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def client(vllm_flags_server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_flags_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt_tokens(server: RemoteServer, messages: list[dict[str, object]]) -> int:
    response = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    return int(response.json()["count"])


def test_create_instructions_and_usage(vllm_flags_server: RemoteServer, client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_NAME, input="Name a colour.", instructions="Answer in one word.", max_output_tokens=6
    )
    assert response.object == "response" and response.id.startswith("resp")
    assert response.status in ("completed", "incomplete") and response.output_text
    [message] = [item for item in response.output if item.type == "message"]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    # The instructions are the system message of the chat the model saw.
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert response.usage is not None
    assert response.usage.input_tokens == _prompt_tokens(vllm_flags_server, messages)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_previous_response_id_continues_the_conversation(
    vllm_flags_server: RemoteServer, client: openai.OpenAI
) -> None:
    first = client.responses.create(
        model=MODEL_NAME, input="My name is Ada.", max_output_tokens=5, temperature=0
    )
    second = client.responses.create(
        model=MODEL_NAME, input="What is my name?", previous_response_id=first.id, max_output_tokens=5
    )
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage is not None and second.usage.input_tokens == _prompt_tokens(
        vllm_flags_server, history
    )
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp-unknown")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL_NAME, input="x", background=True)
    assert info.value.body["param"] == "background"  # type: ignore[index]


def test_streamed_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL_NAME, input="Count to three.", max_output_tokens=8, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas and final.output_text == deltas
    # Each item is announced, then closed: added -> part added -> deltas -> text done -> part done -> done.
    order = [k for k in kinds if k.startswith("response.output_") or k.startswith("response.content_part")]
    assert order[0] == "response.output_item.added" and order[1] == "response.content_part.added"
    assert order[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    # The SDK's own accumulating helper reads the same stream.
    with client.responses.stream(model=MODEL_NAME, input="Count to three.", max_output_tokens=8) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text


def test_function_tools(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_NAME,
        input="What is the weather in Paris?",
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # The tool's answer goes back as a function_call_output item, continuing the conversation.
    follow_up = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
        max_output_tokens=8,
    )
    assert follow_up.output_text
    streamed = list(
        client.responses.create(
            model=MODEL_NAME,
            input="Weather in Oslo?",
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=120,
            stream=True,
        )
    )
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
