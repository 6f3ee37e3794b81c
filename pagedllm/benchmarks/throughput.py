"""`pagedllm bench throughput`: offline requests/s and tokens/s, with the HF baseline beside it."""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from dataclasses import asdict, dataclass

from pagedllm.benchmarks import structured_output
from pagedllm.benchmarks.datasets import (
    SampleRequest,
    chat_requests,
    parse_range,
    random_requests,
    render_chat,
)
from pagedllm.benchmarks.hf_baseline import BaselineResult, add_baseline_args, hf_models, run_hf_generate
from pagedllm.benchmarks.lora import add_lora_args, lora_requests
from pagedllm.benchmarks.model_stats import ModelStats
from pagedllm.benchmarks.roofline import Roofline
from pagedllm.config.args import EngineArgs
from pagedllm.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    elapsed: float
    num_requests: int
    num_input_tokens: int
    num_output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed

    @property
    def input_tokens_per_s(self) -> float:
        return self.num_input_tokens / self.elapsed

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_input_tokens + self.num_output_tokens) / self.elapsed


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("throughput", help="Offline throughput (requests/s, tokens/s).")
    group = parser.add_argument_group("Workload")
    group.add_argument(
        "--dataset",
        default="random",
        help="'random' (random token ids), 'json' (chat prompts each asking for JSON under one of a few "
        "schemas, --input-len ignored: run constrained and unconstrained, reporting both and the grammar "
        "compile times) or a JSONL file of chat prompts (rows with 'messages').",
    )
    group.add_argument("--num-prompts", type=int, default=256)
    group.add_argument("--input-len", default="128..512", help="Random prompt length: N or LOW..HIGH.")
    group.add_argument("--output-len", type=int, default=128)
    group.add_argument("--seed-workload", type=int, default=0, help="Seed of the random workload.")
    add_baseline_args(group, "batched generate")
    group.add_argument("--hf-batch-size", type=int, default=32)
    group.add_argument("--output-json", default=None, help="Write the figures to this JSON file.")
    add_lora_args(parser.add_argument_group("LoRA"))
    EngineArgs.add_cli_args(parser)
    return parser


def build_workload(args: argparse.Namespace, llm) -> list[SampleRequest]:
    tokenizer = llm.get_tokenizer()
    if args.dataset == "random":
        special = tuple(getattr(tokenizer, "all_special_ids", ()))
        vocab = llm.llm_engine.model_config.get_vocab_size()
        return random_requests(
            args.num_prompts, parse_range(args.input_len), args.output_len, vocab, args.seed_workload, special
        )
    if args.dataset == "json":
        return structured_output.json_requests(args.num_prompts, args.output_len, tokenizer)
    # Render the chat template once here so both engines see the same token ids.
    return render_chat(chat_requests(args.dataset, args.num_prompts, args.output_len), tokenizer)


def run_pagedllm(llm, requests: list[SampleRequest], loras: list | None = None) -> ThroughputResult:
    """The requests in one generate call; with `loras`, request i runs adapter i mod len(loras)."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    per_prompt = [loras[i % len(loras)] for i in range(len(requests))] if loras else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True, lora_request=per_prompt)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    return ThroughputResult(elapsed, len(requests), num_in, num_out)


def run(args: argparse.Namespace) -> int:
    from pagedllm.llm import LLM

    if args.dataset == "json" and args.baseline == "hf":
        raise ValueError("--baseline hf does not take --dataset json (HF generate has no grammar)")
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM.from_engine_args(engine_args)
    model_config = llm.llm_engine.model_config
    stats = ModelStats.from_model_config(model_config)
    requests = build_workload(args, llm)
    probe = functools.partial(
        Roofline.measure, model_config.dtype, stats.hidden_size, stats.intermediate_size
    )
    before = probe()
    loras = lora_requests(args, llm.llm_engine.engine_config)
    lora_report = None
    if args.dataset == "json":
        structured = _run_structured(llm, requests)
        result = structured.pop("result")
    else:
        structured = None
        if loras:
            result, base = _run_lora_and_base(llm, requests, loras)
            ratio = result.total_tokens_per_s / base.total_tokens_per_s
            lora_report = {"num_loras": len(loras), "base_model": asdict(base), "ratio_lora_vs_base": ratio}
            print(
                f"base model alone: {base.total_tokens_per_s:.1f} total tok/s ({base.elapsed:.1f} s); "
                f"over {len(loras)} LoRA adapters: {result.total_tokens_per_s:.1f} -> {ratio:.3f}x"
            )
        else:
            result = run_pagedllm(llm, requests)
    roofline = before.best(probe())
    compute_limit = roofline.compute_tokens_per_s(stats.num_params)
    report = {
        "model": model_config.model,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "num_requests": result.num_requests,
        "elapsed_s": result.elapsed,
        "requests_per_s": result.requests_per_s,
        "input_tokens_per_s": result.input_tokens_per_s,
        "output_tokens_per_s": result.output_tokens_per_s,
        "total_tokens_per_s": result.total_tokens_per_s,
        "roofline": roofline.describe(),
        "compute_roofline_tokens_per_s": compute_limit,
        "fraction_of_compute_roofline": result.total_tokens_per_s / compute_limit,
    }
    print(
        f"pagedllm: {result.requests_per_s:.2f} requests/s, {result.input_tokens_per_s:.1f} input tok/s, "
        f"{result.output_tokens_per_s:.1f} output tok/s, {result.total_tokens_per_s:.1f} total tok/s "
        f"({result.elapsed:.1f} s)"
    )
    print(
        f"roofline: {roofline.describe()}; compute limit {compute_limit:.0f} tok/s "
        f"-> {report['fraction_of_compute_roofline']:.1%} of it"
    )
    if structured is not None:
        report["structured_outputs"] = structured
    if lora_report is not None:
        report["lora"] = lora_report
    if args.baseline == "hf":
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        baselines = _run_baselines(args, model_config, requests)
        best = max(baselines, key=lambda b: b.total_tokens_per_s)
        report["baselines"] = [
            {
                "dtype": str(b.dtype).removeprefix("torch."),
                **{k: v for k, v in asdict(b).items() if k != "dtype"},
                "output_tokens_per_s": b.output_tokens_per_s,
                "total_tokens_per_s": b.total_tokens_per_s,
            }
            for b in baselines
        ]
        report["ratio_vs_best_hf"] = result.total_tokens_per_s / best.total_tokens_per_s
        print(f"ratio vs best HF ({best.dtype}): {report['ratio_vs_best_hf']:.2f}x total tok/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _run_lora_and_base(
    llm, requests: list[SampleRequest], loras: list
) -> tuple[ThroughputResult, ThroughputResult]:
    """The requests over the adapters and on the base model alone, timed in the order base, adapters,
    adapters, base (a machine load that drifts during the run weighs on both alike); each figure sums
    its two runs."""
    for lora in loras:  # read from disk before the timed runs
        llm.add_lora(lora)
    runs = [
        run_pagedllm(llm, requests, loras if with_lora else None) for with_lora in (False, True, True, False)
    ]

    def total(pair: list[ThroughputResult]) -> ThroughputResult:
        return ThroughputResult(
            *(sum(getattr(r, f) for r in pair) for f in ThroughputResult.__dataclass_fields__)
        )

    return total(runs[1:3]), total([runs[0], runs[3]])


def _run_structured(llm, requests: list[SampleRequest]) -> dict:
    """The json workload: compile times, then the same requests constrained and unconstrained. The
    returned "result" (the constrained run) is the throughput the report leads with."""
    core = getattr(llm.llm_engine.engine_core, "core", None)
    if core is None or core.structured_output_manager is None:
        raise ValueError("--dataset json needs the engine core in this process and a tokenizer")
    compile_report = structured_output.compile_times(core.structured_output_manager)
    for entry in compile_report["schemas"]:
        print(
            f"grammar compile ({compile_report['backend']}) {entry['schema']}: cold "
            f"{entry['cold_s'] * 1e3:.1f} ms, cached {entry['cached_s'] * 1e3:.3f} ms"
        )
    runs = structured_output.run_constrained_and_not(llm, requests)
    num_in = sum(len(r.prompt_token_ids or ()) for r in requests)
    constrained, unconstrained = (
        ThroughputResult(run.elapsed, len(requests), num_in, sum(run.output_lens)) for run in runs
    )
    ratio = constrained.total_tokens_per_s / unconstrained.total_tokens_per_s
    print(
        f"structured outputs: constrained {constrained.output_tokens_per_s:.1f} output tok/s, "
        f"unconstrained {unconstrained.output_tokens_per_s:.1f} (same requests and lengths): "
        f"{ratio:.3f}x; {runs[0].num_valid_json}/{len(requests)} constrained outputs parse as JSON"
    )
    return {
        "result": constrained,
        "constrained": {**asdict(constrained), "total_tokens_per_s": constrained.total_tokens_per_s},
        "unconstrained": {**asdict(unconstrained), "total_tokens_per_s": unconstrained.total_tokens_per_s},
        "ratio_constrained_vs_unconstrained": ratio,
        "num_valid_json": runs[0].num_valid_json,
        "compile": compile_report,
    }


def _run_baselines(
    args: argparse.Namespace, model_config, requests: list[SampleRequest]
) -> list[BaselineResult]:
    results = []
    pad = model_config.hf_config.pad_token_id
    pad = pad if pad is not None else (model_config.hf_config.eos_token_id or 0)
    for name, model in hf_models(model_config, args.hf_dtypes):
        res = run_hf_generate(model, requests, args.hf_batch_size, int(pad))
        print(
            f"HF transformers {name}: {res.output_tokens_per_s:.1f} output tok/s, "
            f"{res.total_tokens_per_s:.1f} total tok/s ({res.elapsed:.1f} s)"
        )
        results.append(res)
    return results
