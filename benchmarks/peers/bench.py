"""pagedllm against the engines a CPU user would pick instead (issue 40), in one run per workload: each
engine in its own subprocess and venv, the same token ids, threads, dtype and KV budget, engines
alternating per repeat; raw figures and pagedllm's ratios printed (and written with --output-json).

    python3 benchmarks/peers/bench.py offline --model M   # (A) offline throughput
    python3 benchmarks/peers/bench.py decode  --model M   # (B) single-stream decode + bandwidth roofline
    python3 benchmarks/peers/bench.py prefill --model M   # (C) time to first token of 512 and 2048 tokens
    python3 benchmarks/peers/bench.py serve   --model M   # (D) pagedllm serve vs vllm serve, vLLM's client

M is an HF directory (engines: pagedllm, vllm, hf) or a .gguf file (pagedllm executing the blocks
quantized, llama.cpp on the same file; add pagedllm-dequantized for pagedllm's float path of the same
file). Peers come from the venvs of benchmarks/peers/install.sh ($PAGEDLLM_PEERS, default /work/peers);
an engine without its venv is skipped with the reason. --quick scales everything down for a look.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the `peers` package
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: pagedllm

from peers import machine, report, runner, serving, workload  # noqa: E402

# --quick: the workloads scaled down (flags given explicitly still win).
QUICK = {
    "repeats": 1,
    "num_prompts": 16,
    "output_len": 16,
    "iters": 1,
    "lengths": "512",
    "max_concurrency": 4,
}
# The workloads' sizes of issue 40 (the offline ones smaller for models of 500M parameters and more).
DEFAULTS = {
    "offline": {"num_prompts": (256, 64), "input_len": "128..512", "output_len": (128, 64)},
    "decode": {"input_len": "128", "output_len": 128, "iters": 3},
    "prefill": {"lengths": "512,2048", "iters": 3},
    "serve": {"num_prompts": 64, "input_len": 256, "output_len": 64, "max_concurrency": 16},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="workload", required=True)
    for name, help_text in (
        ("offline", "(A) offline throughput: every request in one generate call"),
        ("decode", "(B) single-stream decode, with the bandwidth roofline"),
        ("prefill", "(C) time to first token of one prompt per length"),
        ("serve", "(D) pagedllm serve and vllm serve, driven by vllm bench serve"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--model", required=True, help="HF directory or .gguf file")
        p.add_argument("--engines", default=None, help="comma-separated; default by model kind (see above)")
        p.add_argument("--repeats", type=int, default=None, help="runs of every engine (default 2)")
        p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
        p.add_argument("--dtype", default=None, help="default: pagedllm's dtype=auto on this CPU, for all")
        p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of pagedllm and vLLM")
        p.add_argument("--max-num-seqs", type=int, default=256, help="pagedllm's and vLLM's")
        p.add_argument("--llama-parallel", type=int, default=32, help="llama.cpp's parallel sequences in (A)")
        p.add_argument("--hf-batch-size", type=int, default=32, help="HF generate's batch in (A)")
        p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
        for engine in ("pagedllm", "vllm"):
            p.add_argument(
                f"--{engine}-args",
                type=json.loads,
                default={},
                help=f"more {engine} engine options as JSON, e.g. '{{\"max_num_batched_tokens\": 2048}}' "
                "(serve: each becomes --key value, true a bare flag)",
            )
        p.add_argument("--peers-dir", type=Path, default=runner.DEFAULT_PEERS_DIR)
        p.add_argument("--log-dir", type=Path, default=None, help="engine logs and job files (default: a temp dir)")
        p.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
        p.add_argument("--output-json", type=Path, default=None)
        p.add_argument("--quick", action="store_true", help="scaled down: " + json.dumps(QUICK))
        if name in ("offline", "serve"):
            p.add_argument("--num-prompts", type=int, default=None)
        if name in ("offline", "decode", "serve"):
            p.add_argument("--input-len", default=None, help="offline: N or LOW..HIGH")
            p.add_argument("--output-len", type=int, default=None)
        if name in ("decode", "prefill"):
            p.add_argument("--iters", type=int, default=None, help="timed repeats inside each engine run")
        if name == "prefill":
            p.add_argument("--lengths", default=None, help="comma-separated prompt lengths")
        if name == "serve":
            p.add_argument("--max-concurrency", type=int, default=None)
    return parser.parse_args(argv)


def fill_defaults(args: argparse.Namespace, large: bool) -> None:
    """Unset sizes from --quick, else from issue 40's workloads (the 1B sizes for `large` models)."""
    for key, value in {"repeats": 2, **DEFAULTS[args.workload]}.items():
        if getattr(args, key, None) is not None:
            continue
        if args.quick and key in QUICK:
            value = QUICK[key]
        elif isinstance(value, tuple):
            value = value[1] if large else value[0]
        setattr(args, key, value)
    if args.workload == "serve":
        args.input_len, args.output_len = int(args.input_len), int(args.output_len)


def build_job(args: argparse.Namespace, model: workload.ModelFacts) -> dict[str, Any]:
    from pagedllm.benchmarks.datasets import parse_range

    if args.workload == "offline":
        job = workload.offline_job(model, args.num_prompts, parse_range(args.input_len), args.output_len, args.seed)
    elif args.workload == "decode":
        job = workload.decode_job(model, int(args.input_len), args.output_len, args.iters, args.seed)
    else:
        job = workload.prefill_job(model, _lengths(args), args.iters, args.seed)
    return {**job, "model": str(model.path), "engine_args": {"pagedllm": args.pagedllm_args, "vllm": args.vllm_args}}


def _lengths(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in str(args.lengths).split(",")]


def _title(args: argparse.Namespace, model: workload.ModelFacts) -> str:
    a = args
    if a.workload == "offline":
        sizes = f"{a.num_prompts} requests, input {a.input_len}, output {a.output_len}"
    elif a.workload == "decode":
        sizes = f"prompt {a.input_len}, output {a.output_len}, {a.iters} timed per run"
    elif a.workload == "prefill":
        sizes = f"prompts of {a.lengths} tokens, {a.iters} timed per run"
    else:
        sizes = (
            f"vllm bench serve: {a.num_prompts} prompts, random {a.input_len} in / {a.output_len} out, "
            f"max concurrency {a.max_concurrency}"
        )
    return (
        f"{args.workload}: {model.path.name} ({model.num_params / 1e6:.0f}M parameters, {model.kind}), {sizes}; "
        f"{args.threads} threads, {args.dtype}, {args.repeats} repeats"
    )


def _add_bandwidth(runs: list[dict[str, Any]], model: workload.ModelFacts, dtype: str, bandwidth: float) -> None:
    """Decode runs: the weight bytes a step reads times steps/s, and its share of the copy bandwidth."""
    for run in runs:
        result = run["result"]
        if not result.get("ok"):
            continue
        step_bytes = model.step_bytes(dtype, stored=model.kind == "gguf" and runner.ENGINES[run["engine"]].reads_gguf_blocks)
        result["weight_bytes_per_step"] = step_bytes
        result["achieved_gb_s"] = step_bytes * result["decode_tokens_per_s"] / 1e9
        result["fraction_of_copy_bandwidth"] = step_bytes * result["decode_tokens_per_s"] / bandwidth


def _metrics(args: argparse.Namespace) -> list[report.Metric]:
    if args.workload == "prefill":
        return report.prefill_metrics(_lengths(args))
    return {"offline": report.OFFLINE, "decode": report.DECODE, "serve": report.SERVE}[args.workload]


def _print_engines(runs: list[dict[str, Any]]) -> None:
    seen = set()
    for run in runs:
        result = run["result"]
        if run["engine"] in seen or not result.get("ok"):
            continue
        seen.add(run["engine"])
        version = ", ".join(f"{k} {v}" for k, v in result.get("version", {}).items())
        flags = "; ".join(f"{k}={v}" for k, v in result.get("flags", {}).items() if k != "system_info")
        print(f"  {run['engine']}: {version}; load {result.get('load_s', 0):.0f} s\n    {flags}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = workload.read_model(Path(args.model))
    fill_defaults(args, model.large)
    args.dtype = args.dtype or machine.default_dtype()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=f"peers-{args.workload}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = runner.Settings(
        threads=args.threads,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        peers_dir=args.peers_dir,
        log_dir=log_dir,
        timeout_s=args.timeout,
        llama_parallel=args.llama_parallel,
        hf_batch_size=args.hf_batch_size,
    )
    record: dict[str, Any] = {
        "workload": args.workload,
        "model": str(model.path),
        "num_params": model.num_params,
        "machine": machine.describe(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    title = _title(args, model)
    print(title)
    print(f"machine: {json.dumps(record['machine'])}\nlogs: {log_dir}", flush=True)
    bandwidth = machine.copy_bandwidth(args.threads)
    if args.workload == "serve":
        if model.kind != "hf":
            raise SystemExit("serve takes an HF directory (both servers load the same one)")
        engines, skipped = serving.server_engines(args.engines, args.peers_dir)
        run_one = lambda name, tag: serving.run_server(name, model.path, args, settings, tag)  # noqa: E731
    else:
        specs, skipped = runner.choose_engines(args.engines, model.kind, args.peers_dir)
        engines = [s.name for s in specs]
        job = build_job(args, model)
        run_one = lambda name, tag: runner.run_engine(runner.ENGINES[name], job, settings, tag)  # noqa: E731
    for reason in skipped:
        print(f"  skipped {reason}", flush=True)
    if not engines:
        raise SystemExit("no engine to run")
    runs = runner.alternate(engines, run_one, args.repeats, args.workload)
    bandwidth = max(bandwidth, machine.copy_bandwidth(args.threads))
    if args.workload == "decode":
        _add_bandwidth(runs, model, args.dtype, bandwidth)
    summary = report.summarize(runs, _metrics(args), engines)
    report.print_summary(title, summary, engines)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; load average at the end {machine.load_average()}")
    _print_engines(runs)
    record.update(
        copy_bandwidth_gb_s=bandwidth / 1e9,
        load_average_end=machine.load_average(),
        skipped=skipped,
        runs=runs,
        summary=summary,
    )
    if args.output_json:
        args.output_json.write_text(json.dumps(record, indent=1))
    failed = [r for r in runs if not r["result"].get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
