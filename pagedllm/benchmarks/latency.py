"""`pagedllm bench latency`: one batch, repeated; prefill time and per-token decode latency percentiles."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

from pagedllm.benchmarks.datasets import grounded_requests, open_chat_requests, random_requests, render_chat
from pagedllm.benchmarks.gguf_baselines import GGUF_BASELINES, dequantized_args, run_llama_cpp_latency
from pagedllm.benchmarks.hf_baseline import add_baseline_args
from pagedllm.benchmarks.model_stats import (
    worker_attention_backends,
    worker_forward_path_steps,
    worker_weight_bytes_per_step,
)
from pagedllm.benchmarks.roofline import copy_bandwidth
from pagedllm.config.args import EngineArgs
from pagedllm.core.spec_stats import SpecDecodingStats
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("latency", help="Prefill time and decode latency of one batch.")
    group = parser.add_argument_group("Workload")
    group.add_argument("--batch-size", type=int, default=1)
    group.add_argument("--input-len", type=int, default=512)
    group.add_argument("--output-len", type=int, default=128)
    group.add_argument("--num-iters-warmup", type=int, default=1)
    group.add_argument("--num-iters", type=int, default=3)
    group.add_argument(
        "--dataset",
        choices=("random", "grounded", "chat"),
        default="random",
        help="'random' token ids of --input-len; 'grounded': edit/rewrite/extractive-summary prompts over a "
        "given text of ~500 tokens (where speculative decoding by prompt lookup applies); 'chat': open-ended "
        "chat prompts. The built-in prompts run --num-prompts in all, --batch-size at a time, each "
        "until its end of sequence or --output-len.",
    )
    group.add_argument("--num-prompts", type=int, default=4, help="Prompts of --dataset grounded/chat.")
    group.add_argument(
        "--spec-baseline",
        action="store_true",
        help="With --speculative-config: first run the same prompts without speculation, and report the "
        "decode speed-up.",
    )
    add_baseline_args(group, "prefill and greedy decode", (*GGUF_BASELINES, "llama.cpp"))
    group.add_argument("--output-json", default=None, help="Write the figures to this JSON file.")
    EngineArgs.add_cli_args(parser)
    return parser


@dataclass
class BatchResult:
    prefill_s: float
    # Seconds of each decode step (a step may emit several tokens per request with speculation).
    decode_steps: list[float]
    num_decode_tokens: int
    spec: SpecDecodingStats


def run_batch(engine, prompts: list[list[int]], output_len: int, tag: str, ignore_eos: bool = True) -> BatchResult:
    """Runs one batch to completion."""
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    started: set[str] = set()
    prefill = 0.0
    decode_steps: list[float] = []
    num_decode_tokens = 0
    spec = SpecDecodingStats()
    last = start
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        stats = engine.scheduler_stats
        if stats is not None and stats.spec_num_drafts:
            spec.num_drafts += stats.spec_num_drafts
            spec.num_draft_tokens += stats.spec_num_draft_tokens
            spec.num_accepted_tokens += stats.spec_num_accepted_tokens
        if len(started) < len(prompts):
            started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
            if len(started) == len(prompts):
                prefill = now - start
        elif outputs:
            decode_steps.append(now - last)
            num_decode_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
        last = now
    return BatchResult(prefill, decode_steps, num_decode_tokens, spec)


def measure(args: argparse.Namespace, label: str = "pagedllm") -> tuple[dict, object, list[list[int]]]:
    """One engine's figures (the report), its model config and the prompts it ran."""
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    # After load, before any request: the weights, the KV pool and the runtime, as the process holds
    # them (quantized layers at their stored size). The in-process executor's worker is counted; another
    # executor's worker processes are not.
    rss_after_load = psutil.Process().memory_info().rss
    model_config = engine.model_config
    reqs = random_requests(
        args.batch_size,
        (args.input_len, args.input_len),
        args.output_len,
        model_config.get_vocab_size(),
        seed=0,
    )
    prompts = [r.prompt_token_ids for r in reqs]
    for i in range(args.num_iters_warmup):
        run_batch(engine, prompts, args.output_len, f"warmup{i}")
    bandwidth = copy_bandwidth()  # again after the iterations; the better reading is the limit
    prefills, steps = [], []
    paths_before = _path_steps(engine)
    for i in range(args.num_iters):
        # Each iteration must recompute its prompts, not hit the previous iteration's cached blocks.
        engine.reset_prefix_cache()
        res = run_batch(engine, prompts, args.output_len, f"iter{i}")
        prefills.append(res.prefill_s)
        steps.extend(res.decode_steps)
    step_ms = np.asarray(steps) * 1000.0
    # The way the measured steps' forwards ran (the first rank's; every rank takes the same way).
    paths = {k: n - paths_before.get(k, 0) for k, n in _path_steps(engine).items() if n > paths_before.get(k, 0)}
    # As the loaded model holds its weights (quantized layers at their stored size), all ranks' parts.
    weight_bytes = sum(engine.call_utility("collective_rpc", worker_weight_bytes_per_step, (), None, None))
    bandwidth = max(bandwidth, copy_bandwidth())
    limit = bandwidth / weight_bytes
    report = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "prefill_s_median": float(np.median(prefills)),
        "prefill_tokens_per_s": args.batch_size * args.input_len / float(np.median(prefills)),
        # None with --output-len 1: the prompt step emits the only token, no decode step runs.
        "decode_step_ms": None,
        "decode_tokens_per_s": None,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "rss_after_load_mib": rss_after_load / 2**20,
        "weight_bytes_per_step": weight_bytes,
        "bandwidth_roofline_steps_per_s": limit,
        "fraction_of_bandwidth_roofline": None,
        "decode_paths": paths,
        # The attention backend of each step class (`pagedllm.attention.backends.hybrid`), for the
        # steps whose forward runs the attention layers (a native-c step runs its own kernels).
        "attention_backends": engine.call_utility("collective_rpc", worker_attention_backends, (), None, None)[0],
    }
    print(
        f"{label} prefill: {report['prefill_s_median'] * 1000:.1f} ms for {args.batch_size}x{args.input_len} "
        f"tokens ({report['prefill_tokens_per_s']:.0f} tok/s)"
    )
    if len(step_ms):
        pct = report["decode_step_ms"] = {f"p{p}": float(np.percentile(step_ms, p)) for p in (50, 90, 99)}
        report["decode_tokens_per_s"] = decode_tok_s = args.batch_size * 1000.0 / pct["p50"]
        report["fraction_of_bandwidth_roofline"] = (1000.0 / pct["p50"]) / limit
        print(
            f"{label} decode step: p50 {pct['p50']:.2f} ms, p90 {pct['p90']:.2f} ms, p99 {pct['p99']:.2f} ms "
            f"-> {decode_tok_s:.1f} tok/s; bandwidth roofline {limit:.1f} steps/s from {weight_bytes / 1e6:.1f} MB "
            f"a step ({report['fraction_of_bandwidth_roofline']:.1%})"
        )
    else:
        print(f"{label} decode: no decode steps (--output-len {args.output_len})")
    print(f"{label} decode path: " + ", ".join(f"{path} ({n} steps)" for path, n in sorted(paths.items())))
    backends = report["attention_backends"]
    print(f"{label} attention backends: " + "; ".join(f"{step}: {', '.join(names)}" for step, names in backends.items()))
    print(f"{label} resident memory after load: {report['rss_after_load_mib']:.0f} MiB (this process)")
    engine.shutdown()
    return report, model_config, prompts


def _path_steps(engine: Any) -> dict[str, int]:
    return engine.call_utility("collective_rpc", worker_forward_path_steps, (), None, None)[0]


def run(args: argparse.Namespace) -> int:
    if args.dataset != "random":
        return run_dataset(args)
    report, model_config, prompts = measure(args)
    if args.baseline == "hf":
        report["baselines"] = _hf_baselines(args, model_config, prompts, report)
    elif args.baseline == "gguf-dequantized":
        if model_config.gguf_file is None:
            raise SystemExit("--baseline gguf-dequantized needs a GGUF model")
        base, _, _ = measure(dequantized_args(args), "dequantized")
        ratios = _ratios(report, base)
        report["baselines"] = [{"name": "gguf-dequantized", **base, **ratios}]
        print(
            f"quantized vs dequantized: prefill {ratios['prefill_ratio']:.2f}x, decode {_times(ratios['decode_ratio'])}"
        )
    elif args.baseline == "llama.cpp":
        report["baselines"] = [_llama_cpp_baseline(args, model_config, prompts, report)]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _ratio(ours: dict, theirs: dict, key: str) -> float | None:
    """ours[key] / theirs[key], None where either side has no figure (no decode steps)."""
    return ours[key] / theirs[key] if ours[key] is not None and theirs[key] is not None else None


def _ratios(ours: dict, theirs: dict) -> dict[str, float | None]:
    return {
        "prefill_ratio": _ratio(ours, theirs, "prefill_tokens_per_s"),
        "decode_ratio": _ratio(ours, theirs, "decode_tokens_per_s"),
    }


def _times(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio is not None else "no decode steps"


def _compared(row: dict) -> str:
    """A baseline's figures and pagedllm's ratios to them, for the console."""
    return (
        f"prefill {row['prefill_tokens_per_s']:.0f} tok/s (pagedllm {row['prefill_ratio']:.2f}x), "
        f"decode {row['decode_tokens_per_s']:.1f} tok/s (pagedllm {_times(row['decode_ratio'])})"
    )


def _llama_cpp_baseline(args: argparse.Namespace, model_config, prompts: list[list[int]], ours: dict) -> dict:
    if model_config.gguf_file is None or args.batch_size != 1:
        raise SystemExit("--baseline llama.cpp needs a GGUF model and --batch-size 1")
    res = run_llama_cpp_latency(model_config.gguf_file, prompts[0], args.output_len, args.num_iters)
    theirs = {"prefill_tokens_per_s": args.input_len / res.prefill_s, "decode_tokens_per_s": 1.0 / res.decode_step_s}
    row = {"name": "llama.cpp", "threads": res.threads, **theirs, **_ratios(ours, theirs)}
    print(f"llama.cpp ({res.threads} threads): {_compared(row)}")
    return row


def _hf_baselines(
    args: argparse.Namespace, model_config, prompts: list[list[int]], ours: dict
) -> list[dict[str, float | str]]:
    from pagedllm.benchmarks.hf_baseline import hf_models, run_hf_latency

    rows: list[dict[str, float | str]] = []
    for name, model in hf_models(model_config, args.hf_dtypes):
        res = run_hf_latency(model, prompts, args.output_len)
        theirs = {
            "prefill_tokens_per_s": args.batch_size * args.input_len / res.prefill_s,
            "decode_tokens_per_s": args.batch_size / res.decode_step_s,
        }
        row: dict = {"dtype": name, **theirs, **_ratios(ours, theirs)}
        print(f"HF transformers {name}: {_compared(row)}")
        rows.append(row)
    return rows


def _decode_speed(engine, prompts: list[list[int]], args: argparse.Namespace, tag: str) -> dict[str, float]:
    """Decode tokens/s (every decode token over the decode time) of the prompts, --batch-size at a time
    (each to its end of sequence), and the acceptance figures of speculation."""
    for i in range(args.num_iters_warmup):
        run_batch(engine, prompts[: args.batch_size], args.output_len, f"{tag}-warmup{i}", ignore_eos=False)
    decode_s = 0.0
    tokens = 0
    spec = SpecDecodingStats()
    for start in range(0, len(prompts), args.batch_size):
        engine.reset_prefix_cache()
        res = run_batch(engine, prompts[start : start + args.batch_size], args.output_len, f"{tag}-{start}", False)
        decode_s += sum(res.decode_steps)
        tokens += res.num_decode_tokens
        spec.num_drafts += res.spec.num_drafts
        spec.num_draft_tokens += res.spec.num_draft_tokens
        spec.num_accepted_tokens += res.spec.num_accepted_tokens
    out = {"decode_tokens": tokens, "decode_s": decode_s, "decode_tokens_per_s": tokens / max(decode_s, 1e-9)}
    if spec.num_drafts:
        out["mean_acceptance_length"] = 1 + spec.num_accepted_tokens / spec.num_drafts
        out["draft_acceptance_rate"] = spec.num_accepted_tokens / max(spec.num_draft_tokens, 1)
    return out


def run_dataset(args: argparse.Namespace) -> int:
    """`--dataset grounded|chat`: decode speed on built-in prompts, optionally against no speculation."""
    from pagedllm.engine.llm_engine import LLMEngine

    make = grounded_requests if args.dataset == "grounded" else open_chat_requests
    engine_args = EngineArgs.from_cli_args(args)
    runs: list[tuple[str, EngineArgs]] = []
    if args.spec_baseline:
        if engine_args.speculative_config is None:
            raise ValueError("--spec-baseline needs --speculative-config")
        runs.append(("plain", dataclasses.replace(engine_args, speculative_config=None)))
    runs.append(("speculative" if engine_args.speculative_config is not None else "plain", engine_args))
    report: dict[str, object] = {"dataset": args.dataset, "num_prompts": args.num_prompts}
    prompts: list[list[int]] = []
    for name, ea in runs:
        engine = LLMEngine.from_engine_args(ea)
        if not prompts:
            requests = render_chat(make(args.num_prompts, args.output_len), engine.get_tokenizer())
            prompts = [r.prompt_token_ids for r in requests]  # type: ignore[misc]
            report["mean_prompt_len"] = float(np.mean([len(p) for p in prompts]))
        report[name] = res = _decode_speed(engine, prompts, args, name)
        engine.shutdown()
        line = f"{name}: {res['decode_tokens']} decode tokens in {res['decode_s']:.2f} s -> {res['decode_tokens_per_s']:.1f} tok/s"
        if "mean_acceptance_length" in res:
            line += (
                f", mean acceptance length {res['mean_acceptance_length']:.2f}"
                f" (draft acceptance rate {res['draft_acceptance_rate']:.1%})"
            )
        print(line)
    if args.spec_baseline:
        ratio = report["speculative"]["decode_tokens_per_s"] / report["plain"]["decode_tokens_per_s"]  # type: ignore[index]
        report["speedup"] = ratio
        print(f"speculative / plain decode speed: {ratio:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
