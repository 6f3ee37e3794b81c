"""`pagedllm bench kv-offload`: a multi-turn chat workload whose prefixes outgrow the KV pool, run without
and then with the offloading tier (`kv_offloading_size`) in one invocation.

Each of `--conversations` conversations has `--turns` turns; a turn's prompt is the whole conversation so
far (earlier prompts and answers) plus `--user-len` new tokens, and it answers `--output-len` tokens.
Turns go round the conversations (turn 1 of each, then turn 2 of each, ...), so by the time a
conversation comes back its prefix has been evicted from a pool sized at 1 / `--prefix-ratio` of all the
conversations' final lengths. Without the tier each turn recomputes its whole history; with it, the
history comes back from the tier. Reported: TTFT percentiles (arrival to first token, engine side) and
throughput (tokens / s, prompt and generated) of each run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import numpy as np

from pagedllm.config.args import EngineArgs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "kv-offload", help="Multi-turn chat past the KV pool: without vs with the offloading tier."
    )
    group = parser.add_argument_group("Workload")
    group.add_argument("--conversations", type=int, default=8)
    group.add_argument("--turns", type=int, default=6)
    group.add_argument("--user-len", type=int, default=128, help="New tokens per user turn.")
    group.add_argument("--output-len", type=int, default=16, help="Tokens answered per turn.")
    group.add_argument(
        "--prefix-ratio", type=float, default=4.0, help="All conversations' final lengths / the KV pool."
    )
    group.add_argument(
        "--offload-gib", type=float, default=1.0, help="kv_offloading_size of the run with the tier."
    )
    group.add_argument("--output-json", default=None, help="Write the figures to this JSON file.")
    EngineArgs.add_cli_args(parser)
    return parser


def conversations(n: int, turns: int, user_len: int, vocab: int) -> list[list[list[int]]]:
    """Per conversation, the new user tokens of each turn (random ids, fixed seed)."""
    rng = random.Random(0)
    return [[[rng.randrange(10, vocab) for _ in range(user_len)] for _ in range(turns)] for _ in range(n)]


def run_workload(engine, users: list[list[list[int]]], output_len: int) -> dict[str, float]:
    """All turns, round robin over the conversations; each round's requests go in together."""
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    history: list[list[int]] = [[] for _ in users]
    ttfts: list[float] = []
    prompt_tokens = generated = 0
    start = time.perf_counter()
    for turn in range(len(users[0])):
        arrival: dict[str, float] = {}
        for c, turns in enumerate(users):
            history[c] = history[c] + turns[turn]
            req_id = f"c{c}-t{turn}"
            arrival[req_id] = time.perf_counter()
            engine.add_request(req_id, {"prompt_token_ids": history[c]}, params)
            prompt_tokens += len(history[c])
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.outputs[0].token_ids if out.outputs else []
                if not new:
                    continue
                c = int(out.request_id[1:].split("-")[0])
                if out.request_id in arrival:
                    ttfts.append(time.perf_counter() - arrival.pop(out.request_id))
                history[c] = history[c] + list(new)
                generated += len(new)
    elapsed = time.perf_counter() - start
    ms = np.asarray(ttfts) * 1000.0
    return {
        "ttft_ms_p50": float(np.percentile(ms, 50)),
        "ttft_ms_p90": float(np.percentile(ms, 90)),
        "ttft_ms_mean": float(ms.mean()),
        "duration_s": elapsed,
        "total_tokens_per_s": (prompt_tokens + generated) / elapsed,
        "output_tokens_per_s": generated / elapsed,
        "requests": len(ttfts),
    }


def run(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    base = EngineArgs.from_cli_args(args)
    final_len = args.turns * (args.user_len + args.output_len)
    probe = base.create_engine_config()
    block_size = probe.cache_config.block_size
    pool_blocks = -(-int(args.conversations * final_len / args.prefix_ratio) // block_size)
    max_model_len = probe.model_config.max_model_len
    if pool_blocks * block_size < max(max_model_len, final_len):
        raise SystemExit(
            f"the pool ({pool_blocks} blocks of {block_size}) must hold one max_model_len={max_model_len} and "
            f"one whole conversation ({final_len} tokens): lower --max-model-len, or raise --conversations "
            "or lower --prefix-ratio"
        )
    users = conversations(args.conversations, args.turns, args.user_len, probe.model_config.get_vocab_size())
    report: dict[str, object] = {
        "conversations": args.conversations,
        "turns": args.turns,
        "user_len": args.user_len,
        "output_len": args.output_len,
        "pool_blocks": pool_blocks,
        "prefix_tokens": args.conversations * final_len,
    }
    for name, extra in (("without_tier", {}), ("with_tier", {"kv_offloading_size": args.offload_gib})):
        engine_args = dataclasses.replace(base, num_gpu_blocks_override=pool_blocks, **extra)
        engine = LLMEngine.from_engine_args(engine_args)
        try:
            result = run_workload(engine, users, args.output_len)
        finally:
            engine.shutdown()
        report[name] = result
        print(
            f"{name}: TTFT p50 {result['ttft_ms_p50']:.0f} ms, p90 {result['ttft_ms_p90']:.0f} ms; "
            f"{result['total_tokens_per_s']:.0f} tok/s total, {result['output_tokens_per_s']:.1f} output tok/s "
            f"({result['duration_s']:.1f} s)"
        )
    without, with_tier = report["without_tier"], report["with_tier"]
    assert isinstance(without, dict) and isinstance(with_tier, dict)
    report["ttft_p50_speedup"] = without["ttft_ms_p50"] / with_tier["ttft_ms_p50"]
    report["throughput_speedup"] = with_tier["total_tokens_per_s"] / without["total_tokens_per_s"]
    print(
        f"tier vs none: TTFT p50 {report['ttft_p50_speedup']:.2f}x lower, throughput "
        f"{report['throughput_speedup']:.2f}x (pool {pool_blocks} blocks = 1/{args.prefix_ratio:g} of "
        f"{report['prefix_tokens']} prefix tokens)"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
