"""Batch-invariant execution (PAGEDLLM_BATCH_INVARIANT): padded products, and a request's tokens and
logprobs bitwise the same alone, beside other requests, and on a prefix-cache hit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.worker.batch_invariant import BatchInvariantMode

PROMPT = "Paged attention stores keys and values in fixed-size blocks. Continuous batching"
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, logprobs=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    x = torch.randn(48, 64, generator=gen).to(dtype)
    with BatchInvariantMode():
        full = F.linear(x, weight)
        for start, rows in [(0, 1), (0, 3), (5, 7), (2, 13), (0, 17), (9, 30)]:
            assert torch.equal(F.linear(x[start : start + rows], weight), full[start : start + rows])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


def _logprobs(output) -> list[list[tuple[int, float]]]:  # type: ignore[no-untyped-def]
    return [[(t, lp.logprob) for t, lp in step.items()] for step in output.logprobs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flag_makes_a_request_bitwise_independent_of_its_batch(
    model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "1")
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=256, enforce_eager=True, optimization_level=0)
    assert llm.llm_engine.engine_core.core.model_executor.driver_worker.runner.batch_invariant
    alone = llm.generate([PROMPT], SEEDED, use_tqdm=False)[0].outputs[0]
    rng = random.Random(0)
    others = ["Hello, world! " * rng.randint(1, 6) for _ in range(5)]
    params = [
        SamplingParams(temperature=rng.choice([0.0, 0.9]), max_tokens=rng.randint(4, 24)) for _ in others
    ]
    batch = llm.generate(
        [*others[:2], PROMPT, *others[2:]], [*params[:2], SEEDED, *params[2:]], use_tqdm=False
    )
    # Again alone: the prompt's full blocks now come from the prefix cache (a shorter prefill).
    again = llm.generate([PROMPT], SEEDED, use_tqdm=False)[0].outputs[0]
    for other in (batch[2].outputs[0], again):
        assert other.token_ids == alone.token_ids
        assert _logprobs(other) == _logprobs(alone)
