"""Chat template rendering: same text as transformers' apply_chat_template, message validation, overrides."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pagedllm.chat_template import apply_chat_template, parse_chat_messages
from pagedllm.tokenizer import get_tokenizer

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with ünïcödé 🎨"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    return get_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(
    tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = apply_chat_template(tokenizer, conversation, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_text_parts_are_joined_with_newlines(tokenizer: Any) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "two"}]}
    ]
    plain = [{"role": "user", "content": "line one\ntwo"}]
    assert apply_chat_template(tokenizer, parts) == apply_chat_template(tokenizer, plain)


def test_pydantic_like_messages_are_accepted(tokenizer: Any) -> None:
    class Message:
        def __init__(self, role: str, content: str) -> None:
            self.role, self.content = role, content

        def model_dump(self, exclude_none: bool = False) -> dict[str, Any]:
            return {"role": self.role, "content": self.content}

    assert apply_chat_template(tokenizer, [Message("user", "Hi")]) == apply_chat_template(
        tokenizer, CONVERSATIONS[0]
    )


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([], ValueError, "at least one message"),
        ([{"role": 5, "content": "x"}], ValueError, r"messages\[0\].role must be a non-empty string, got 5"),
        ([{"content": "x"}], ValueError, r"messages\[0\].role must be a non-empty string, got None"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], ValueError, "only 'text'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], TypeError, "must be a string"),
        (["hello"], TypeError, "must be a mapping"),
        ([{"role": "user", "content": 5}], TypeError, "string or a list"),
        ([{"role": "tool", "content": "42"}], ValueError, r"messages\[0\].tool_call_id is required"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{a"}}],
                }
            ],
            ValueError,
            r"messages\[0\].tool_calls: arguments are not valid JSON",
        ),
    ],
)
def test_bad_messages(messages: list[Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_chat_messages(messages)


def test_custom_roles_reach_the_template(tokenizer: Any) -> None:
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
    messages = [{"role": "robot", "content": "beep"}, {"role": "user", "content": "Hi"}]
    assert apply_chat_template(tokenizer, messages, chat_template=template) == "[robot|beep][user|Hi]"


def test_developer_role_is_system_for_templates_without_it(tokenizer: Any) -> None:
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # SmolLM2's template knows no developer role: the message is its system prompt, as HF renders one.
    expected = tokenizer.apply_chat_template(system, tokenize=False, add_generation_prompt=True)
    assert apply_chat_template(tokenizer, developer) == expected
    # A template that handles the role itself gets it as sent.
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }};{% endfor %}"
    assert apply_chat_template(tokenizer, developer, chat_template=knows) == "D:Be brief.;Hi;"


def test_none_content_becomes_empty_and_extra_keys_stay() -> None:
    parsed = parse_chat_messages([{"role": "assistant", "content": None, "name": "bot"}])
    assert parsed == [{"role": "assistant", "content": "", "name": "bot"}]


def test_template_override_string_and_file(tokenizer: Any, tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ eos_token }}"
    expected = "[user|Hi]<|im_end|>"
    assert apply_chat_template(tokenizer, CONVERSATIONS[0], chat_template=template) == expected
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert apply_chat_template(tokenizer, CONVERSATIONS[0], chat_template=str(path)) == expected
    with pytest.raises(ValueError, match="neither a template nor a file"):
        apply_chat_template(tokenizer, CONVERSATIONS[0], chat_template=str(tmp_path / "missing.jinja"))


def test_generation_prompt_flag_reaches_template() -> None:
    tok = SimpleNamespace(
        chat_template="{{ messages[0].content }}{% if add_generation_prompt %}>>{% endif %}"
    )
    assert apply_chat_template(tok, CONVERSATIONS[0], add_generation_prompt=True) == "Hi>>"
    assert apply_chat_template(tok, CONVERSATIONS[0], add_generation_prompt=False) == "Hi"


def test_continue_final_message(tokenizer: Any) -> None:
    conversation = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    text = apply_chat_template(
        tokenizer, conversation, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\none, two,")
    with pytest.raises(ValueError, match="cannot both be true"):
        apply_chat_template(tokenizer, conversation, add_generation_prompt=True, continue_final_message=True)


def test_missing_template_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(SimpleNamespace(chat_template=None), CONVERSATIONS[0])


def test_tools_reach_the_template() -> None:
    tok = SimpleNamespace(chat_template="{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert apply_chat_template(tok, CONVERSATIONS[0], tools=tools) == "[lookup]"
    assert apply_chat_template(tok, CONVERSATIONS[0]) == ""


def test_tool_calls_and_results_reach_the_template_with_dict_arguments() -> None:
    # HF templates iterate over the arguments; OpenAI clients send them as a JSON string.
    tok = SimpleNamespace(
        chat_template="{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "{{ m.tool_call_id or '' }}={{ m.content }};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert (
        apply_chat_template(tok, messages, add_generation_prompt=False)
        == "user:=Weather?;assistant:w(Oslo)=;tool:c1=sunny;"
    )


def test_operator_and_model_templates_render_sandboxed() -> None:
    """Templates rendered in-process (the model's, the operator's --chat-template, `LLM.chat`'s) run in
    jinja2's ImmutableSandboxedEnvironment too: no Python internals, no mutation of the messages."""
    from jinja2.sandbox import SecurityError

    tok = SimpleNamespace(chat_template="{{ ().__class__.__base__.__subclasses__() }}")
    with pytest.raises(SecurityError):
        apply_chat_template(tok, [{"role": "user", "content": "Hi"}])
    with pytest.raises(SecurityError):
        apply_chat_template(tok, [{"role": "user", "content": "Hi"}], chat_template="{{ messages.append(1) }}")
