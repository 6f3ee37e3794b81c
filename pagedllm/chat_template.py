"""Render chat conversations into prompt text with the model's Jinja chat template.

Shared by `LLM.chat` and the OpenAI server. Messages are normalised first (roles checked to be strings, content given
as a string or as a list of ``{"type": "text"}`` parts joined with newlines, as vLLM does for the
"string" content format), then rendered with transformers' sandboxed Jinja renderer, so a template
behaves exactly as under ``tokenizer.apply_chat_template`` while working for any tokenizer object that
carries a ``chat_template`` string and its special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.sandbox import SecurityError
from transformers.utils.chat_template_utils import render_jinja_template

from pagedllm.errors import RequestError

# OpenAI's newer name for the system role. A template that never mentions it gets "system" instead, as
# OpenAI treats developer messages for models trained before the role existed.
DEVELOPER_ROLE = "developer"

# A conversation as users write it: role/content mappings, or objects (e.g. pydantic models of the
# server's request schema) exposing `model_dump()`.
ChatMessage = Mapping[str, Any]
Conversation = list[ChatMessage]


def _message_to_dict(message: Any, index: int) -> dict[str, Any]:
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, Mapping):
        raise TypeError(
            f"messages[{index}] must be a mapping with 'role' and 'content', got {type(message).__name__}"
        )
    return dict(message)


def _content_to_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Iterable) or isinstance(content, Mapping):
        raise TypeError(f"messages[{index}].content must be a string or a list of content parts")
    texts: list[str] = []
    for part_index, part in enumerate(content):
        part = _message_to_dict(part, index)
        part_type = part.get("type")
        if part_type != "text":
            raise RequestError(
                "messages",
                f"messages[{index}].content[{part_index}] has type {part_type!r}: only 'text' content parts are "
                "supported",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise TypeError(f"messages[{index}].content[{part_index}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _tool_call_for_template(call: Any, index: int) -> dict[str, Any]:
    """An assistant's tool call with its arguments as a dict: OpenAI sends them as a JSON string, chat
    templates (HF's, vLLM's) iterate over them as a mapping."""
    call = _message_to_dict(call, index)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(
                "messages", f"messages[{index}].tool_calls: arguments are not valid JSON: {e}"
            ) from e
    return {**call, "function": function}


def parse_chat_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """Validate a conversation and return plain ``{"role", "content": str, ...}`` dicts.

    Extra keys (e.g. ``name``) are kept: some templates read them.
    """
    conversation: list[dict[str, Any]] = []
    for index, raw in enumerate(messages):
        message = _message_to_dict(raw, index)
        role = message.get("role")
        # Any role goes to the template (custom roles included), as in vLLM: the template decides.
        if not isinstance(role, str) or not role:
            raise RequestError("messages", f"messages[{index}].role must be a non-empty string, got {role!r}")
        message["content"] = _content_to_text(message.get("content"), index)
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise RequestError(
                "messages", f"messages[{index}].tool_call_id is required for a message with role 'tool'"
            )
        if message.get("tool_calls"):
            message["tool_calls"] = [_tool_call_for_template(call, index) for call in message["tool_calls"]]
        conversation.append(message)
    if not conversation:
        raise RequestError("messages", "messages must contain at least one message")
    return conversation


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The template to use: an override (a Jinja string or a path to a file holding one), else the tokenizer's."""
    # Imported here: it loads torch, which the template sandbox process (importing this module) must not.
    from pagedllm.tokenizer import resolve_chat_template as tokenizer_resolve_chat_template

    template = tokenizer_resolve_chat_template(tokenizer, chat_template)
    if isinstance(template, Mapping):
        # Tokenizers may ship several named templates; "default" is the one used for plain chat.
        template = template.get("default")
    if not template:
        raise RequestError(
            "chat_template",
            "The tokenizer has no chat template: pass chat_template= (a Jinja template string or a file path)",
        )
    return str(template)


def _special_tokens(tokenizer: Any) -> dict[str, str]:
    special = getattr(tokenizer, "special_tokens_map", None)
    tokens = {key: str(value) for key, value in dict(special or {}).items() if isinstance(value, str)}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            tokens.setdefault(name, value)
    return tokens


# The arguments render_jinja_template takes itself: a chat_template_kwargs key may not replace them (a
# template smuggled in as "chat_template" included).
_RENDER_ARGUMENTS = frozenset(
    {"conversations", "chat_template", "tools", "add_generation_prompt", "continue_final_message"}
)


def describe_render_error(error: Exception) -> tuple[str, str]:
    """`(field at fault, message)` for an error rendering a chat template."""
    if isinstance(error, TemplateSyntaxError):
        return "chat_template", f"chat_template is not a valid Jinja template: {error}"
    if isinstance(error, SecurityError):  # e.g. attribute access to Python internals
        return "chat_template", f"chat_template was blocked by the sandbox: {error}"
    if isinstance(error, TemplateError):
        # Raised while rendering: templates call raise_exception() on conversations they refuse (e.g.
        # roles that do not alternate), so the messages are at fault.
        return "messages", f"The chat template refused the messages: {error}"
    if isinstance(error, RequestError):
        return error.param or "messages", error.message
    if isinstance(error, (ValueError, TypeError)):  # a message of the wrong shape
        return "messages", str(error)
    return "chat_template", f"chat_template failed to render: {type(error).__name__}: {error}"


class ChatRender(msgspec.Struct, forbid_unknown_fields=True):
    """One conversation ready to render: plain data, so that it can be rendered in another process (the
    server renders templates sent in requests in a sandbox process)."""

    template: str
    conversation: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    tools: list[dict[str, Any]] | None
    variables: dict[str, Any]
    """The tokenizer's special tokens and the request's chat_template_kwargs."""

    def render(self) -> str:
        """The prompt text, rendered in transformers' sandboxed Jinja environment."""
        rendered, _ = render_jinja_template(
            conversations=[self.conversation],
            chat_template=self.template,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            tools=self.tools,
            **self.variables,
        )
        return rendered[0]


def prepare_chat_render(
    tokenizer: Any,
    messages: Iterable[Any],
    template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> ChatRender:
    """Check a conversation and gather what rendering it takes. ``template`` is the template's text
    (never a path), None for the tokenizer's own."""
    if add_generation_prompt and continue_final_message:
        raise RequestError(
            "continue_final_message", "add_generation_prompt and continue_final_message cannot both be true"
        )
    reserved = sorted(_RENDER_ARGUMENTS & set(chat_template_kwargs or {}))
    if reserved:
        raise RequestError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}")
    template = template if template is not None else resolve_chat_template(tokenizer)
    conversation = parse_chat_messages(messages)
    if DEVELOPER_ROLE not in template:
        for message in conversation:
            if message["role"] == DEVELOPER_ROLE:
                message["role"] = "system"
    return ChatRender(
        template,
        conversation,
        add_generation_prompt,
        continue_final_message,
        tools,
        {**_special_tokens(tokenizer), **dict(chat_template_kwargs or {})},
    )


def apply_chat_template(
    tokenizer: Any,
    messages: Iterable[Any],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render one conversation to prompt text (tokenize it with ``add_special_tokens=False``: the template
    already wrote the special tokens). ``chat_template``: the caller's own template, as text or a path to a
    file holding it. ``tools`` (OpenAI's function specs) are shown to templates that render them."""
    template = resolve_chat_template(tokenizer, chat_template)
    return prepare_chat_render(
        tokenizer,
        messages,
        template,
        add_generation_prompt,
        continue_final_message,
        chat_template_kwargs,
        tools,
    ).render()
