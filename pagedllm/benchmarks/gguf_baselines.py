"""Baselines of a GGUF model run from its blocks: the same file dequantized (`gguf-dequantized`, the
float path of the same engine) and llama.cpp (`llama.cpp`, through llama-cpp-python, the optional
`llamacpp` extra) on the same file with the same thread count."""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GGUF_BASELINES = ("gguf-dequantized",)


def dequantized_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the GGUF weights loaded dequantized (`model_loader_extra_config` gguf_dequantize)."""
    out = copy.deepcopy(args)
    out.model_loader_extra_config = {**(args.model_loader_extra_config or {}), "gguf_dequantize": True}
    return out


@dataclass
class LlamaCppLatency:
    prefill_s: float
    decode_step_s: float
    threads: int


def run_llama_cpp_latency(gguf_file: Path, prompt: list[int], output_len: int, iters: int) -> LlamaCppLatency:
    """llama.cpp's prefill of `prompt` and greedy decode steps (median over `iters` runs), with as
    many threads as torch uses here."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(
            "--baseline llama.cpp needs llama-cpp-python (the optional `llamacpp` extra of pagedllm)"
        ) from None
    threads = torch.get_num_threads()
    llm = Llama(
        model_path=str(gguf_file),
        n_ctx=len(prompt) + output_len + 8,
        n_batch=max(512, len(prompt)),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    prefills, steps = [], []
    for _ in range(iters + 1):  # the first run warms up
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        token = int(llm.scores[llm.n_tokens - 1].argmax())
        start = time.perf_counter()
        for _ in range(output_len - 1):
            llm.eval([token])
            token = int(llm.scores[llm.n_tokens - 1].argmax())
        prefills.append(prefill)
        steps.append((time.perf_counter() - start) / max(1, output_len - 1))
    prefills, steps = sorted(prefills[1:]), sorted(steps[1:])
    return LlamaCppLatency(prefills[len(prefills) // 2], steps[len(steps) // 2], threads)
