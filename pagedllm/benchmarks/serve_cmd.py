"""`pagedllm bench serve`: the command-line face of pagedllm.benchmarks.serve."""

from __future__ import annotations

import argparse
import asyncio
import json

from pagedllm.benchmarks.datasets import (
    SampleRequest,
    chat_requests,
    grounded_requests,
    open_chat_requests,
    parse_range,
    random_requests,
)
from pagedllm.benchmarks.serve import (
    mean_acceptance_length,
    run_serve_benchmark,
    spec_decode_counters,
    summarize,
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="Online benchmark against an OpenAI-compatible server.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root URL.")
    parser.add_argument("--model", required=True, help="Model name the server serves.")
    parser.add_argument(
        "--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"]
    )
    parser.add_argument(
        "--dataset",
        default="random",
        help="'random' (token-id prompts, completions endpoint), 'grounded' / 'chat' (the built-in "
        "summarize-rewrite-edit and open-ended chat prompts) or a JSONL of chat prompts.",
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", default="128", help="Random prompt length: N or LOW..HIGH.")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--vocab-size", type=int, default=32000, help="Random token ids are drawn below this."
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second (Poisson arrivals); inf sends all at once.",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="Send vLLM's ignore_eos extension field.")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--output-json", default=None)
    return parser


def _requests(args: argparse.Namespace) -> list[SampleRequest]:
    if args.dataset == "random":
        return random_requests(
            args.num_prompts, parse_range(args.input_len), args.output_len, args.vocab_size
        )
    if args.dataset == "grounded":
        return grounded_requests(args.num_prompts, args.output_len)
    if args.dataset == "chat":
        return open_chat_requests(args.num_prompts, args.output_len)
    return chat_requests(args.dataset, args.num_prompts, args.output_len)


def run(args: argparse.Namespace) -> int:
    spec_before = spec_decode_counters(args.base_url)
    results, duration = asyncio.run(
        run_serve_benchmark(
            args.base_url,
            args.model,
            _requests(args),
            endpoint=args.endpoint,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
        )
    )
    summary = summarize(results, duration)
    acceptance = mean_acceptance_length(spec_before, spec_decode_counters(args.base_url))
    if acceptance is not None:
        # From the server's vllm:spec_decode_* counters (shared with any other client meanwhile).
        summary["mean_acceptance_length"] = acceptance
    for key, value in summary.items():
        print(f"{key:>24}: {value:.2f}" if isinstance(value, float) else f"{key:>24}: {value}")
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"first error: {errors[0]}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if not errors else 1
