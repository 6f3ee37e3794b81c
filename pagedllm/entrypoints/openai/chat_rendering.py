"""Which chat template renders a chat request's prompt (`/v1/chat/completions`, `/tokenize`), and where.

- The operator's `--chat-template` (text or a file, read at start-up) or the model's own template render
  in this process, in a worker thread (transformers' sandboxed Jinja environment).
- A request's `chat_template` is refused (400 naming it) unless the server runs with
  `--trust-request-chat-template`; even then it is template text, never a path to read, and it renders
  in the sandbox process (`template_sandbox`: bounded in time, memory and output size).
Rendering never runs on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedllm.chat_template import ChatRender, describe_render_error, prepare_chat_render
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.template_sandbox import TemplateSandbox
from pagedllm.errors import RequestError
from pagedllm.tokenizer import resolve_chat_template

UNTRUSTED_TEMPLATE = (
    "chat_template in a request is refused: this server does not run templates from clients "
    "(start it with --trust-request-chat-template to accept them)"
)


def load_chat_template(chat_template: str) -> str:
    """The server's --chat-template (a Jinja string or a file path) as template text, checked once at start-up
    so that a typo fails `pagedllm serve` instead of every chat request (ValueError naming the problem)."""
    template = resolve_chat_template(None, chat_template)  # type: ignore[arg-type]  # an override needs no tokenizer
    assert template is not None  # an override always resolves to text, or raises
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from e
    return template


def _render_error(error: Exception) -> OpenAIError:
    param, message = describe_render_error(error)
    return OpenAIError(message, param=param)


class ChatPromptRenderer:
    def __init__(
        self,
        tokenizer: Any,
        operator_template: str | None,
        sandbox: TemplateSandbox | None,
        default_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``operator_template``: --chat-template's text (None: the model's); ``sandbox``: where request
        templates render (None: they are refused, as without --trust-request-chat-template);
        ``default_kwargs``: --default-chat-template-kwargs (a request's own chat_template_kwargs win)."""
        self.tokenizer = tokenizer
        self.operator_template = operator_template
        self.sandbox = sandbox
        self.default_kwargs = default_kwargs or {}

    def _prepare(self, template: str | None, messages: list[Any], **options: Any) -> ChatRender:
        try:
            return prepare_chat_render(self.tokenizer, messages, template, **options)
        except Exception as e:
            raise _render_error(e) from e

    def _render_here(self, messages: list[Any], **options: Any) -> str:
        job = self._prepare(self.operator_template, messages, **options)
        try:
            return job.render()
        except Exception as e:
            raise _render_error(e) from e

    async def render(
        self,
        messages: list[Any],
        request_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a chat request (OpenAIError, a 400 naming the field at fault)."""
        options: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": {**self.default_kwargs, **(chat_template_kwargs or {})},
            "tools": tools,
        }
        if request_template is None:
            return await asyncio.to_thread(self._render_here, messages, **options)
        if self.sandbox is None:
            raise OpenAIError(UNTRUSTED_TEMPLATE, param="chat_template")
        job = await asyncio.to_thread(self._prepare, request_template, messages, **options)
        try:
            return await self.sandbox.render(job)
        except RequestError as e:
            raise OpenAIError(e.message, param=e.param) from e
