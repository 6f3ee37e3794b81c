"""`pagedllm bench throughput|latency|serve|startup|embed|kv-offload`."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "throughput": "pagedllm.benchmarks.throughput",
    "latency": "pagedllm.benchmarks.latency",
    "serve": "pagedllm.benchmarks.serve_cmd",
    "startup": "pagedllm.benchmarks.startup",
    "embed": "pagedllm.benchmarks.embed",
    "kv-offload": "pagedllm.benchmarks.kv_offload",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help=f"Benchmarks: {'|'.join(BENCHMARKS)}.")
    bench = parser.add_subparsers(dest="benchmark", metavar="<benchmark>", required=True)
    for module in BENCHMARKS.values():
        importlib.import_module(module).add_parser(bench)
    return parser


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(BENCHMARKS[args.benchmark]).run(args))
