"""`pagedllm bench serve`: the command-line face of pagedllm.benchmarks.serve."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

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

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Random token ids are drawn below this where no tokenizer is at hand (Llama 2's vocabulary: most
# models' are larger).
DEFAULT_VOCAB_SIZE = 32000


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="Online benchmark against an OpenAI-compatible server.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root URL.")
    parser.add_argument("--model", required=True, help="Model name the server serves.")
    parser.add_argument(
        "--endpoint",
        default=None,
        choices=[COMPLETIONS, CHAT],
        help=f"Default: {COMPLETIONS} for the random dataset, {CHAT} for the chat datasets (whose "
        "messages the completions endpoint gets as one prompt, their contents joined by newlines).",
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
        "--tokenizer",
        default=None,
        help="Tokenizer (a directory or a .gguf file) whose vocabulary random prompts are drawn from, "
        "its special tokens left out (default: --model where that is a path, as the server names a "
        "model served from a path).",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"Random token ids are drawn below this (default: the tokenizer's vocabulary, else "
        f"{DEFAULT_VOCAB_SIZE}).",
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
    parser.add_argument(
        "--baseline-url",
        default=None,
        help="Run the same requests against this server first and report --base-url's figures against it.",
    )
    return parser


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint is None:
        return COMPLETIONS if args.dataset == "random" else CHAT
    if args.endpoint == CHAT and args.dataset == "random":
        raise ValueError(
            f"--dataset random sends token-id prompts, which {CHAT} does not take: use --endpoint "
            f"{COMPLETIONS} or a chat dataset (--dataset grounded|chat|FILE.jsonl)"
        )
    return str(args.endpoint)


def _vocabulary(args: argparse.Namespace) -> tuple[int, tuple[int, ...]]:
    """The random prompts' vocabulary size and the special token ids left out of them."""
    source = args.tokenizer or (args.model if Path(args.model).exists() else None)
    if source is None:
        return args.vocab_size or DEFAULT_VOCAB_SIZE, ()
    from pagedllm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(source)
    return args.vocab_size or len(tokenizer), tuple(tokenizer.all_special_ids)


def _requests(args: argparse.Namespace) -> list[SampleRequest]:
    if args.dataset == "random":
        vocab_size, special_ids = _vocabulary(args)
        return random_requests(
            args.num_prompts, parse_range(args.input_len), args.output_len, vocab_size, special_ids=special_ids
        )
    if args.dataset == "grounded":
        return grounded_requests(args.num_prompts, args.output_len)
    if args.dataset == "chat":
        return open_chat_requests(args.num_prompts, args.output_len)
    return chat_requests(args.dataset, args.num_prompts, args.output_len)


def _bench(args: argparse.Namespace, base_url: str) -> tuple[dict[str, float], list[str]]:
    spec_before = spec_decode_counters(base_url)
    results, duration = asyncio.run(
        run_serve_benchmark(
            base_url,
            args.model,
            _requests(args),
            endpoint=_endpoint(args),
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
        )
    )
    summary = summarize(results, duration)
    print(f"--- {base_url}")
    acceptance = mean_acceptance_length(spec_before, spec_decode_counters(base_url))
    if acceptance is not None:
        # From the server's vllm:spec_decode_* counters (shared with any other client meanwhile).
        summary["mean_acceptance_length"] = acceptance
    for key, value in summary.items():
        print(f"{key:>24}: {value:.2f}" if isinstance(value, float) else f"{key:>24}: {value}")
    return summary, [r.error for r in results if not r.ok]


def run(args: argparse.Namespace) -> int:
    _endpoint(args)  # a dataset the endpoint cannot take fails before any request
    report: dict[str, object] = {}
    errors: list[str] = []
    if args.baseline_url:
        baseline, errors = _bench(args, args.baseline_url)
        report["baseline"] = baseline
    summary, more = _bench(args, args.base_url)
    errors += more
    report.update(summary)
    if args.baseline_url:
        ratios = {
            "p50_ttft_ratio": baseline["p50_ttft_ms"] / summary["p50_ttft_ms"],
            "output_throughput_ratio": summary["output_throughput"] / baseline["output_throughput"],
        }
        report.update(ratios)
        print(
            f"vs baseline: p50 TTFT {ratios['p50_ttft_ratio']:.2f}x lower, output throughput "
            f"{ratios['output_throughput_ratio']:.2f}x"
        )
    if errors:
        print(f"first error: {errors[0]}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if not errors else 1
