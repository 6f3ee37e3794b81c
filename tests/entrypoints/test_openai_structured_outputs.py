"""Structured outputs through the real server with the official openai client, sampling at temperature
1.0: a chat json_schema response validates, streamed or not; a nested schema's streamed deltas joined
validate; every one of n=4 chat choices validates; a streamed completion under a schema, chat with
guided_choice / guided_regex and a GBNF grammar match; a completion's guided_regex holds for each of n=2
choices (each its own matcher); and conflicting or bad constraints, or ones over the server's default
limits, are 400s naming the field the client set."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from remote_server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["color", "count"],
}

# Objects, an array of objects, enums, integer bounds and required fields.
NESTED = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "maxLength": 8},
        "level": {"enum": ["junior", "senior"]},
        "members": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "age": {"type": "integer", "minimum": 18, "maximum": 70},
                },
                "required": ["name", "age"],
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["team", "level", "members"],
}
NESTED_TOO_DEEP: dict = {"type": "integer"}
for _ in range(40):
    NESTED_TOO_DEEP = {"type": "object", "properties": {"a": NESTED_TOO_DEEP}}
# A tiny arithmetic language, in xgrammar's GBNF.
GRAMMAR = 'root ::= num (op num){0,2}\nop ::= "+" | "-" | "*"\nnum ::= [1-9] [0-9]?'
ARITHMETIC = r"[1-9][0-9]?([-+*][1-9][0-9]?){0,2}"


@pytest.fixture(scope="module")
def server(tool_server: RemoteServer) -> RemoteServer:
    # The tool-call tests' server (the grammar that holds tool arguments is this module's subject too).
    return tool_server


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_json_schema(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Pick a color and a count."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True},
        },
        temperature=1.0,
        seed=3,
        max_tokens=40,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def chat(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=1.0, **kwargs
    )


def complete(client: openai.OpenAI, prompt: str, **kwargs: Any) -> Any:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=1.0, **kwargs)


def test_chat_nested_json_schema_streamed(client: openai.OpenAI) -> None:
    stream = chat(
        client,
        "Describe a small software team as JSON.",
        response_format={"type": "json_schema", "json_schema": {"name": "team", "schema": NESTED}},
        seed=1,
        max_tokens=200,
        stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text = "".join(deltas)
    assert finish == "stop" and len([d for d in deltas if d]) > 1, text
    jsonschema.validate(json.loads(text), NESTED)


def test_chat_n4_every_choice_validates(client: openai.OpenAI) -> None:
    response = chat(
        client,
        "Describe a small software team as JSON.",
        n=4,
        seed=2,
        max_tokens=120,
        extra_body={"structured_outputs": {"json": NESTED, "disable_any_whitespace": True}},
    )
    assert len(response.choices) == 4
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), NESTED)


def test_completion_json_schema_streamed(client: openai.OpenAI) -> None:
    stream = complete(
        client,
        "A color and a count as JSON:",
        seed=4,
        max_tokens=40,
        stream=True,
        extra_body={"guided_json": SCHEMA},
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra_body", "pattern"),
    [
        ({"guided_choice": ["Paris", "Lima", "Oslo"]}, "Paris|Lima|Oslo"),
        ({"guided_regex": r"[A-Z][a-z]{2,6}-[0-9]{3}"}, r"[A-Z][a-z]{2,6}-[0-9]{3}"),
        ({"structured_outputs": {"grammar": GRAMMAR}}, ARITHMETIC),
    ],
)
def test_chat_choice_regex_and_grammar(client: openai.OpenAI, extra_body: dict, pattern: str) -> None:
    response = chat(client, "Name a city and a number.", seed=6, max_tokens=24, extra_body=extra_body)
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert re.fullmatch(pattern, choice.message.content or ""), choice.message.content


def test_completion_guided_regex_n2(client: openai.OpenAI) -> None:
    response = complete(
        client,
        "My phone number is",
        n=2,
        seed=5,
        max_tokens=16,
        extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"},
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", choice.text), choice.text


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
            "response_format",
            "cannot be combined with guided_json",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_regex": "b"},
            "structured_outputs",
            "cannot be combined",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}},
            "response_format",
            "cannot be combined with structured_outputs",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "only one of"),
        ({"guided_json": {"type": "object", "required": "color"}}, "guided_json", "is invalid"),
        (
            {"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
            "structured_outputs",
            "structured_outputs.json is invalid",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
            "is invalid",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "structured_outputs.regex is invalid"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "is invalid"),
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
        # Over the default limits (each took a grammar engine seconds to minutes): refused at once.
        ({"guided_regex": "[a-z]{1,5000}"}, "guided_regex", "structured_outputs_config.max_regex_repetition"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a|aa)*(b|bb)*{0,10000}"}},
                }
            },
            "response_format",
            "max_regex_repetition",
        ),
        ({"guided_choice": [str(i) for i in range(1001)]}, "guided_choice", "max_enum_members"),
        ({"structured_outputs": {"json": {"enum": list(range(5000))}}}, "structured_outputs", "max_enum_members"),
        ({"guided_json": NESTED_TOO_DEEP}, "guided_json", "max_schema_depth"),
        ({"guided_grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(20000))}, "guided_grammar", "max_schema_bytes"),
    ],
)
@pytest.mark.parametrize(
    ("endpoint", "prompt"),
    [
        ("completions", {"prompt": "Hi"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    server: RemoteServer, endpoint: str, prompt: dict, body: dict, param: str, words: str
) -> None:
    request = {"model": MODEL_NAME, "max_tokens": 2, **prompt, **body}
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=request, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
