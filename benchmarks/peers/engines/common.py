"""What every engine process of the peer benchmark runs: a job file in, a result file out, and the same
timed loops around each engine's one `generate` call, so the engines differ in that call only.

Standard library only: this module runs under each engine's own venv (vLLM's, llama.cpp's, ours).

    <venv python> engines/<engine>_engine.py JOB.json RESULT.json

A job names the workload and carries every prompt as token ids (the driver drew them once, for all
engines). `generate(prompts, output_len)` runs the prompts to exactly `output_len` tokens each (greedy,
end of sequence ignored) and returns how many tokens came out; the loops check that count, so an engine
that stopped early fails the run instead of looking fast.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], output_len: int) -> int: ...

    def describe(self) -> dict[str, Any]:
        """{"version": {...}, "flags": {...}, "notes": [...]}: what ran, as the engine resolved it."""
        ...


def _timed(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    start = time.perf_counter()
    produced = engine.generate(prompts, output_len)
    elapsed = time.perf_counter() - start
    expected = len(prompts) * output_len
    if produced != expected:
        raise RuntimeError(f"generated {produced} tokens, expected {expected} (is end of sequence ignored?)")
    return elapsed


def offline(engine: Engine, job: dict[str, Any]) -> dict[str, Any]:
    """(A) Every prompt in one call, after a warm-up call on other prompts."""
    _timed(engine, job["warmup_prompts"], job["warmup_output_len"])
    prompts, output_len = job["prompts"], job["output_len"]
    elapsed = _timed(engine, prompts, output_len)
    num_in = sum(len(p) for p in prompts)
    num_out = len(prompts) * output_len
    return {
        "elapsed_s": elapsed,
        "num_requests": len(prompts),
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
    }


def decode(engine: Engine, job: dict[str, Any]) -> dict[str, Any]:
    """(B) One stream: a decode step is (time of a prompt to N tokens - time of a prompt to 1 token) /
    (N - 1), two distinct prompts of the same length each repeat (nothing a prefix cache could reuse);
    medians over the repeats."""
    output_len = job["output_len"]
    _timed(engine, [job["warmup_prompt"]], output_len)
    firsts, steps = [], []
    for one, full in job["prompt_pairs"]:
        first = _timed(engine, [one], 1)
        whole = _timed(engine, [full], output_len)
        firsts.append(first)
        steps.append((whole - first) / (output_len - 1))
    step = statistics.median(steps)
    return {
        "ttft_s": statistics.median(firsts),
        "decode_step_s": step,
        "decode_steps_s": steps,
        "decode_tokens_per_s": 1.0 / step,
    }


def prefill(engine: Engine, job: dict[str, Any]) -> dict[str, Any]:
    """(C) Time to first token of one prompt per length (a prompt to one token), after a warm-up prompt
    of the same length; medians over the repeats, each on its own prompt."""
    out = {}
    for length, prompts in job["prompts_by_length"].items():
        _timed(engine, [prompts["warmup"]], 1)
        times = [_timed(engine, [p], 1) for p in prompts["timed"]]
        ttft = statistics.median(times)
        out[length] = {"ttft_s": ttft, "ttft_all_s": times, "prefill_tokens_per_s": int(length) / ttft}
    return {"by_length": out}


WORKLOADS: dict[str, Callable[[Engine, dict[str, Any]], dict[str, Any]]] = {
    "offline": offline,
    "decode": decode,
    "prefill": prefill,
}


class OfflineLLM:
    """An engine with vLLM's offline API (`LLM.generate` on `{"prompt_token_ids": ...}` prompts with
    `SamplingParams`): vLLM itself, and pagedllm, which keeps its names."""

    def __init__(self, llm: Any, sampling_params: type) -> None:
        self.llm, self.sampling_params = llm, sampling_params

    def generate(self, prompts: list[list[int]], output_len: int) -> int:
        params = self.sampling_params(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)


def llm_kwargs(job: dict[str, Any], engine: str) -> dict[str, Any]:
    """The `LLM(...)` arguments pagedllm and vLLM share (same names in both), plus `engine`'s extras."""
    return {
        "model": job["model"],
        "dtype": job["dtype"],
        "max_model_len": job["max_model_len"],
        "max_num_seqs": job["max_num_seqs"],
        "seed": 0,
        **job.get("engine_args", {}).get(engine, {}),
    }


def config_summary(config: Any, fields: dict[str, str]) -> dict[str, Any]:
    """`fields` (label -> dotted attribute path) read from an engine's resolved config, as text; a
    path the engine lacks reads None. vLLM and pagedllm share the names."""
    out: dict[str, Any] = {}
    for label, path in fields.items():
        value: Any = config
        for part in path.split("."):
            value = getattr(value, part, None)
        out[label] = None if value is None else str(value)
    return out


# The resolved settings recorded from vLLM's and pagedllm's configs (the same names in both).
ENGINE_CONFIG_FIELDS = {
    "dtype": "model_config.dtype",
    "max_model_len": "model_config.max_model_len",
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler_config.enable_chunked_prefill",
    "enable_prefix_caching": "cache_config.enable_prefix_caching",
    "block_size": "cache_config.block_size",
    "kv_cache_memory_bytes": "cache_config.kv_cache_memory_bytes",
    "compilation_mode": "compilation_config.mode",
    "compilation_backend": "compilation_config.backend",
    "quantization": "model_config.quantization",
}


def main(load: Callable[[dict[str, Any]], Engine]) -> None:
    job_path, result_path = Path(sys.argv[1]), Path(sys.argv[2])
    job = json.loads(job_path.read_text())
    try:
        start = time.perf_counter()
        engine = load(job)
        load_s = time.perf_counter() - start
        figures = WORKLOADS[job["workload"]](engine, job)
        result = {"ok": True, "load_s": load_s, **engine.describe(), **figures}
    except Exception as exc:  # the driver reports it beside the other engines' figures
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result_path.write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    sys.stderr.flush()
