"""The baseline measured beside every throughput figure: HF transformers' batched `generate` on the same
weights, prompts, dtype and output lengths (left-padded batches, greedy, EOS ignored)."""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.benchmarks.datasets import SampleRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_baseline_args(group: argparse._ArgumentGroup, what: str, others: Sequence[str] = ()) -> None:
    """`--baseline none|hf` (and the benchmark's `others`) and `--hf-dtypes`, shared by the benchmarks
    that measure HF beside them."""
    group.add_argument(
        "--baseline",
        choices=["none", "hf", *others],
        default="none",
        help=f"Also run HF transformers' {what} (or another baseline) on the same prompts and print the ratio."
        + (" gguf-dequantized: the same GGUF file loaded dequantized (the float path)." if others else "")
        + (" llama.cpp: llama-cpp-python on the same file and thread count." if "llama.cpp" in others else ""),
    )
    group.add_argument("--hf-dtypes", default="float32,bfloat16", help="Baseline dtypes (comma separated).")


def hf_models(model_config: Any, dtypes: str) -> Iterator[tuple[str, torch.nn.Module]]:
    """The HF model of `model_config` in each dtype of the comma-separated `dtypes`, one at a time
    (each is released before the next loads)."""
    names = dtypes.split(",")
    for name in names:
        if name not in DTYPES:
            raise ValueError(f"--hf-dtypes: unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    for name in names:
        model = load_hf_model(model_config.model_path, model_config.gguf_file, DTYPES[name])
        yield name, model
        del model
        gc.collect()


@dataclass
class BaselineResult:
    dtype: torch.dtype
    elapsed: float
    num_input_tokens: int
    num_output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_input_tokens + self.num_output_tokens) / self.elapsed


def load_hf_model(model_path: Path, gguf_file: Path | None, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file.name} if gguf_file is not None else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, **kwargs)
    return model.eval()


@dataclass
class LatencyBaseline:
    dtype: torch.dtype
    prefill_s: float  # one forward over the (equal-length) prompts
    decode_step_s: float  # median time of one greedy decode step of the batch


@torch.inference_mode()
def run_hf_latency(
    model: torch.nn.Module, prompts: list[list[int]], output_len: int, repeats: int = 3
) -> LatencyBaseline:
    """HF's prefill time (a forward over the prompts) and decode step time (generate's extra time per
    new token beyond the prefill), best of `repeats` each, for prompts of equal length."""
    dtype = next(model.parameters()).dtype
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    prefill = decode = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, use_cache=True)
        prefill = min(prefill, time.perf_counter() - start)
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        decode = min(decode, (time.perf_counter() - start - prefill) / max(output_len - 1, 1))
    return LatencyBaseline(dtype, prefill, decode)


@torch.inference_mode()
def run_hf_generate(
    model: torch.nn.Module, requests: list[SampleRequest], batch_size: int, pad_token_id: int
) -> BaselineResult:
    """Greedy-generate every request's `output_len` tokens in left-padded batches of `batch_size`."""
    dtype = next(model.parameters()).dtype
    num_in = num_out = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        prompts = [r.prompt_token_ids for r in batch]
        assert all(p is not None for p in prompts), "the HF baseline takes token-id prompts"
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        max_new = max(r.output_len for r in batch)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        assert out.shape[1] == width + max_new
        num_in += sum(len(p) for p in prompts)
        num_out += sum(r.output_len for r in batch)
    return BaselineResult(dtype, time.perf_counter() - start, num_in, num_out)
