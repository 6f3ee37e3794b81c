"""`pagedllm chat [engine options]`: an interactive chat in the terminal.

Reads one user message per line from stdin, renders the whole conversation so far with the model's
chat template and streams the reply to stdout as it is generated. ``/reset`` starts a new conversation,
``/exit`` (or end of input) quits. A message that no longer fits the context is reported and dropped, so
the conversation can go on (or be reset).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any, TextIO

from pagedllm.chat_template import apply_chat_template
from pagedllm.config.args import EngineArgs
from pagedllm.engine.input_processor import TokensPrompt
from pagedllm.entrypoints.generate import add_sampling_args, sampling_params_from_args
from pagedllm.entrypoints.startup_errors import report_startup_error
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chat",
        help="Chat with the model in the terminal.",
        description="An interactive chat: one message per line on stdin; /reset starts over, /exit quits.",
    )
    parser.add_argument("--system", default=None, help="A system message that opens every conversation.")
    parser.add_argument(
        "--chat-template",
        default=None,
        help="A Jinja chat template (string or file) to use instead of the model's.",
    )
    add_sampling_args(parser, default_max_tokens=256)
    EngineArgs.add_cli_args(parser)
    return parser


class ChatSession:
    """A conversation with history, streaming each reply to ``out``."""

    def __init__(
        self,
        engine: Any,
        params: SamplingParams,
        system: str | None = None,
        chat_template: str | None = None,
        out: TextIO = sys.stdout,
    ) -> None:
        self.engine = engine
        self.params = params.clone()
        # Stream the reply: each step hands back only the new text.
        self.params.output_kind = RequestOutputKind.DELTA
        self.system = system
        self.chat_template = chat_template
        self.out = out
        self.history: list[dict[str, str]] = []
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, message: str) -> str:
        """Add a user message, stream the reply, keep both in the history; returns the reply."""
        tokenizer = self.engine.get_tokenizer()
        conversation = [*self.history, {"role": "user", "content": message}]
        text = apply_chat_template(tokenizer, conversation, chat_template=self.chat_template)
        prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(text, add_special_tokens=False), prompt=text)
        request_id = f"chat-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, self.params)
        pieces: list[str] = []
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    piece = output.outputs[0].text
                    pieces.append(piece)
                    self.out.write(piece)
                    self.out.flush()
        except BaseException:
            self.engine.abort_request(request_id)
            raise
        self.out.write("\n")
        self.out.flush()
        reply = "".join(pieces)
        self.history = [*conversation, {"role": "assistant", "content": reply}]
        return reply


def chat_loop(session: ChatSession, lines: TextIO, interactive: bool) -> None:
    while True:
        if interactive:
            session.out.write("> ")
            session.out.flush()
        line = lines.readline()
        if not line:
            return
        message = line.strip()
        if not message:
            continue
        if message in EXIT_COMMANDS:
            return
        if message == RESET_COMMAND:
            session.reset()
            continue
        try:
            session.send(message)
        except ValueError as e:
            # Usually the conversation outgrew the context: say so and let the user go on or /reset.
            print(f"error: {e}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        params = sampling_params_from_args(args)
    except ValueError as e:
        print(f"pagedllm chat: {e}", file=sys.stderr)
        return 2
    if params.n != 1:
        print("pagedllm chat: --n is not supported by chat (one reply per message)", file=sys.stderr)
        return 2
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    except (ValueError, TypeError) as e:  # a bad flag or a broken model: one line, not a traceback
        return report_startup_error("chat", e)
    try:
        session = ChatSession(engine, params, system=args.system, chat_template=args.chat_template)
        chat_loop(session, sys.stdin, interactive=sys.stdin.isatty())
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        engine.shutdown()
    return 0
