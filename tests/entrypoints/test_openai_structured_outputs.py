"""Structured outputs through the real server with the official openai client: a chat json_schema
response validates, a completion's guided_regex holds for each of n=2 choices (each its own matcher),
and conflicting or bad constraints are 400s naming the field the client set."""

from __future__ import annotations

import json
import re

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


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


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


def test_completion_guided_regex_n2(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="My phone number is",
        n=2,
        temperature=1.0,
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
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "only one of"),
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
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    server: RemoteServer, body: dict, param: str, words: str
) -> None:
    request = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
