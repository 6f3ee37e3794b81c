"""The `pagedllm` command: `pagedllm <command> [options]`.

A command is a module exposing `add_parser(subparsers) -> argparse.ArgumentParser` (it calls
`subparsers.add_parser(<its name>, ...)` and adds its flags, usually with `EngineArgs.add_cli_args`) and
`run(args: argparse.Namespace) -> int` (the exit status). Register one with a line in `SUBCOMMANDS`.
Only the module of the command being run is imported, so `pagedllm --help` stays fast.

A command may also expose `start_early() -> object`: called before its parser is built (building it
imports torch, ~2 s), unless help was asked for; what it returns reaches `run` as `args.started_early`
(`pagedllm serve` starts its engine process there).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from pagedllm.config.arg_parser import FlexibleArgumentParser


@dataclass(frozen=True)
class Subcommand:
    module: str
    """Module with `add_parser(subparsers)` and `run(args) -> int`."""
    help: str
    """One line for `pagedllm --help` (shown without importing the module)."""


SUBCOMMANDS: dict[str, Subcommand] = {
    "config": Subcommand("pagedllm.entrypoints.config_cmd", "Show the resolved engine configuration."),
    "generate": Subcommand("pagedllm.entrypoints.generate", "Generate completions of prompts offline."),
    "chat": Subcommand("pagedllm.entrypoints.chat", "Chat with the model in the terminal."),
    "serve": Subcommand("pagedllm.entrypoints.serve", "Start the OpenAI-compatible API server."),
    "bench": Subcommand(
        "pagedllm.benchmarks.cli", "Benchmarks: throughput|latency|serve|startup|embed|kv-offload."
    ),
    "disagg-proxy": Subcommand("pagedllm.entrypoints.disagg_proxy", "Disaggregated prefill proxy."),
    "watermark": Subcommand("pagedllm.entrypoints.watermark_cmd", "Detect output watermarks."),
    "env": Subcommand("pagedllm.entrypoints.env_cmd", "Show the CPU, kernel builds and decode paths."),
}


def _load(name: str) -> ModuleType:
    module = importlib.import_module(SUBCOMMANDS[name].module)
    for attr in ("add_parser", "run"):
        if not callable(getattr(module, attr, None)):
            raise TypeError(f"subcommand {name!r}: module {module.__name__} has no {attr}() function")
    return module


def build_parser(command: str | None = None) -> tuple[FlexibleArgumentParser, ModuleType | None]:
    """The top-level parser; only `command`'s module is imported and adds its real flags."""
    from pagedllm import __version__

    parser = FlexibleArgumentParser(
        prog="pagedllm", description="pagedllm: LLM inference and serving on CPUs and NVIDIA GPUs."
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    module: ModuleType | None = None
    for name, entry in SUBCOMMANDS.items():
        if name != command:
            # A placeholder: enough for the command list in --help and for argparse's choice check.
            subparsers.add_parser(name, help=entry.help)
            continue
        module = _load(name)
        module.add_parser(subparsers)
        if name not in subparsers.choices:
            raise TypeError(
                f"subcommand {name!r}: {module.__name__}.add_parser() did not add a parser named {name!r}"
            )
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list[:1] if a in SUBCOMMANDS), None)
    started_early = None
    if command is not None and not {"-h", "--help"} & set(args_list):
        start_early = getattr(_load(command), "start_early", None)
        started_early = start_early() if start_early is not None else None
    parser, module = build_parser(command)
    args = parser.parse_args(args_list, namespace=argparse.Namespace(started_early=started_early))
    assert module is not None, "argparse accepted a command that was not loaded"
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
