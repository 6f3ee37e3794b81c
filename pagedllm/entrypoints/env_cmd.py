"""`pagedllm env`: the machine as the engine sees it (CPU instruction sets, native kernel builds, the
decode path of each dtype), for bug reports; the same as `python -m pagedllm.collect_env`."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        "env",
        help="Show the CPU, kernel builds and decode paths.",
        description="Print the CPU model and vector instruction sets, the C compiler, the flag set each "
        "native kernel library was built with (building any the cache lacks), the dtype dtype=auto picks "
        "and the decode path each dtype takes.",
    )


def run(args: argparse.Namespace) -> int:
    from pagedllm.collect_env import main

    return main()
