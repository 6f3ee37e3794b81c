"""`pagedllm generate "prompt" ... [engine options] [sampling options]`: offline generation from the shell.

Prompts come from the arguments, or one per line from stdin when none are given (or "-"). Each
completion is printed as plain text (one per line, in prompt order), or as JSON lines with ``--json``.
The sampling flags are shared with `pagedllm chat`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedllm.config.args import EngineArgs
from pagedllm.entrypoints.startup_errors import report_startup_error
from pagedllm.sampling_params import SamplingParams

# Sampling flag -> (type, help). Unset flags fall back to the model's generation defaults.
_SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "temperature": (float, "Sampling temperature; 0 is greedy."),
    "top_p": (
        float,
        "Nucleus sampling: keep the most likely tokens up to this total probability, in (0, 1].",
    ),
    "top_k": (int, "Keep only the k most likely tokens (0 or -1: off)."),
    "min_p": (float, "Drop tokens less likely than min_p times the most likely one."),
    "repetition_penalty": (float, "> 1 discourages repeating prompt and output tokens."),
    "presence_penalty": (float, "Penalty for tokens already in the output, in [-2, 2]."),
    "frequency_penalty": (float, "Penalty growing with how often a token appears in the output, in [-2, 2]."),
    "n": (int, "Completions per prompt."),
}


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    group = parser.add_argument_group(
        "Sampling", "Options of every request (unset ones: the model's defaults)."
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=default_max_tokens,
        help=f"Maximum output tokens per completion (default {default_max_tokens}).",
    )
    for name, (kind, text) in _SAMPLING_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=text)
    group.add_argument("--stop", action="append", default=None, help="A stop string (repeat for several).")
    group.add_argument(
        "--ignore-eos", action="store_true", help="Keep generating after the end-of-sequence token."
    )


def sampling_params_from_args(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    """SamplingParams with only the flags the user gave (the rest stay unset for the model defaults)."""
    kwargs: dict[str, Any] = {
        name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None
    }
    kwargs["max_tokens"] = args.max_tokens
    kwargs["ignore_eos"] = args.ignore_eos
    if args.stop:
        kwargs["stop"] = args.stop
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "generate",
        help="Generate completions of prompts offline.",
        description="Generate completions of prompts with the engine in this process.",
    )
    parser.add_argument(
        "prompts", nargs="*", metavar="PROMPT", help="Prompts; none or '-' reads one per line from stdin."
    )
    parser.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="Send each prompt as a user message through the model's chat template.",
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object per completion.")
    parser.add_argument("--progress", action="store_true", help="Show a progress bar with throughput.")
    add_sampling_args(parser, default_max_tokens=64)
    EngineArgs.add_cli_args(parser)
    return parser


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = [p for p in args.prompts if p != "-"]
    if not args.prompts or "-" in args.prompts:
        prompts += [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    if not prompts:
        print("pagedllm generate: no prompt given (pass prompts as arguments or on stdin)", file=sys.stderr)
        return 2
    try:
        params = sampling_params_from_args(args)
    except ValueError as e:
        print(f"pagedllm generate: {e}", file=sys.stderr)
        return 2
    from pagedllm.llm import LLM

    try:
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    except (ValueError, TypeError) as e:  # a bad flag or a broken model: one line, not a traceback
        return report_startup_error("generate", e)
    try:
        if args.apply_chat_template:
            outputs = llm.chat(
                [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=args.progress
            )
        else:
            outputs = llm.generate(prompts, params, use_tqdm=args.progress)
    except ValueError as e:
        print(f"pagedllm generate: {e}", file=sys.stderr)
        return 1
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            if args.json:
                record = {
                    "prompt": prompt,
                    "index": completion.index,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                }
                print(json.dumps(record, ensure_ascii=False))
            else:
                print(completion.text)
    return 0
