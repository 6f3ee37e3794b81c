"""Helpers of the reproducibility tests: whether this machine's default dtype runs the batch-invariant
path (then outputs must agree to the bit), and the comparison of two runs' tokens and logprobs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.layers import bf16_gemm
from pagedllm.platforms import current_platform

# A tiny Llama with heads of 32 (tiny_llm.make_tiny_llm overrides): the prompt-attention kernel serves
# them, so a bfloat16 model runs every step in the batch-invariant native body.
HEAD32 = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32
)


def bitwise_here() -> bool:
    """Whether `dtype=auto` is bfloat16 here and the batch-invariant kernels run (README:
    Reproducibility); elsewhere (float32) only the tokens are guaranteed, by peaked test models."""
    return current_platform.default_dtype(None) == torch.bfloat16 and bf16_gemm.available()


Choice = tuple[list[int], list[list[tuple[int, float]]]]


def choices(results: list[Any]) -> list[Choice]:
    """Per choice of the `RequestOutput`s: its tokens and, per token, its (token, logprob) entries."""
    return [
        (list(c.token_ids), [[(t, lp.logprob) for t, lp in step.items()] for step in c.logprobs])
        for r in results
        for c in r.outputs
    ]


def assert_same(got: list[Choice], want: list[Choice]) -> None:
    """The same tokens, and the same logprobs: bitwise where `bitwise_here`, else to 1e-3."""
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        if bitwise_here():
            assert logprobs == ref_logprobs
            continue
        for step, ref in zip(logprobs, ref_logprobs, strict=True):
            assert [t for t, _ in step] == [t for t, _ in ref]
            assert [lp for _, lp in step] == pytest.approx([lp for _, lp in ref], abs=1e-3)
