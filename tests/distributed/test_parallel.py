"""Tensor and pipeline parallelism under the `mp` executor against one rank: tiny fp32 Llama, Qwen2
and Qwen3 models, greedy tokens identical and the raw logits of every step (top 5) within 1e-4;
pipeline stages overlap (two batches in flight); a killed worker fails the engine within 5 s, naming
its rank, and leaves no process behind. Two stages also run compiled in the machine's default dtype."""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from dtype_tolerance import dtype_atol
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import make_tiny_model  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 8, 100, 42]]
MAX_TOKENS = 5


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(dtype="float32", enforce_eager=True) | kwargs
    return LLM(
        str(model_dir),
        max_model_len=64,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=2**21,
        logprobs_mode="raw_logits",
        **options,
    )


def _generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
        for o in outs
    ]


def _assert_same(got: list[Any], want: list[Any]) -> None:
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        for step, ref_step in zip(logits, ref_logits, strict=True):
            assert step.keys() == ref_step.keys()
            for t, value in step.items():
                assert value == pytest.approx(ref_step[t], abs=1e-4)


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> Any:
    """Workers forked from one server that imported the worker code once (the default `spawn` starts
    a fresh interpreter per worker: the same executor code, seconds more per world on 2 cores)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_WORKER_MULTIPROC_METHOD", "forkserver")
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel")
    # Qwen3: tied embeddings, per-head q/k norms, one KV head (replicated on both TP ranks) and a
    # vocabulary that does not split evenly (the last shard is padded).
    dirs = {"qwen3": root / "qwen3", "qwen2": root / "qwen2", "llama": root / "llama"}
    make_tiny_model("qwen3-qknorm", dirs["qwen3"], num_key_value_heads=1, vocab_size=251)
    make_tiny_model("qwen2-bias", dirs["qwen2"])
    make_tiny_model("llama-llama3rope", dirs["llama"], num_hidden_layers=3)
    return dirs


def _one_rank(model_dir: Path, prompts: list[list[int]] = PROMPTS, **kwargs: Any) -> list[Any]:
    llm = _llm(model_dir, **kwargs)
    try:
        return _generate(llm, prompts)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("model", "tp", "pp"), [("qwen3", 2, 1), ("qwen2", 2, 2)], ids=["qwen3-tp2-gqa1", "qwen2-tp2xpp2"]
)
def test_matches_one_rank(models: dict[str, Path], model: str, tp: int, pp: int) -> None:
    want = _one_rank(models[model])
    llm = _llm(
        models[model], tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )
    try:
        _assert_same(_generate(llm), want)
        # The ranks met through a file store: no worker listens beyond this machine (a TCP store
        # listened on every interface).
        workers = [psutil.Process(p.pid) for p in llm.llm_engine.engine_core.core.model_executor.procs]  # type: ignore[attr-defined]
        listening = [c.laddr for w in workers for c in w.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening
    finally:
        llm.llm_engine.shutdown()


def test_pp2_then_killed_worker_fails_fast_and_leaves_no_process(models: dict[str, Path]) -> None:
    """Llama, 3 layers over 2 stages (2 + 1); then rank 1 is killed between two steps of a request."""
    want = _one_rank(models["llama"])
    llm = _llm(models["llama"], pipeline_parallel_size=2, distributed_executor_backend="mp")
    engine = llm.llm_engine
    pids = [p.pid for p in engine.engine_core.core.model_executor.procs]  # type: ignore[attr-defined]
    assert all(psutil.pid_exists(pid) for pid in pids)
    _assert_same(_generate(llm), want)
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 5
    engine.shutdown()
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert alive == []


# Five requests, one with a 40-token prompt that runs in 16-token chunks (the next chunk may start
# while the previous one is still in the pipeline).
CONCURRENT_PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([6, 9, 40, 5, 12])]


def test_pp2_keeps_two_batches_in_flight(models: dict[str, Path]) -> None:
    """With two stages the engine keeps two batches going (stage 0 runs batch N+1 while stage 1 runs
    batch N), each with half the requests, and the tokens and logits are those of one rank."""
    chunked = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}
    want = _one_rank(models["llama"], CONCURRENT_PROMPTS, **chunked)
    llm = _llm(models["llama"], pipeline_parallel_size=2, distributed_executor_backend="mp", **chunked)
    core = llm.llm_engine.engine_core.core  # type: ignore[attr-defined]
    batches: list[int] = []
    submit = core.model_executor.submit_step

    def counting_submit(scheduler_output: Any, grammar_output: Any) -> Any:
        batches.append(len(scheduler_output.num_scheduled_tokens))
        return submit(scheduler_output, grammar_output)

    core.model_executor.submit_step = counting_submit
    try:
        _assert_same(_generate(llm, CONCURRENT_PROMPTS), want)
        assert core.max_batches_in_flight == 2
        # Balanced: while all five decode, the batches alternate 3 and 2 requests, never all five.
        assert max(batches) == 3 and batches.count(2) >= MAX_TOKENS - 2
    finally:
        llm.llm_engine.shutdown()


def _assert_same_up_to_a_near_tie(got: list[Any], want: list[Any], atol: float) -> None:
    """`_assert_same` within `atol`, for runs in a dtype whose rounding can flip a greedy near-tie of
    the tiny random model: where the picks part, each is within 2 * atol of the other's best in both
    runs; the steps after it run on different contexts and are not compared."""
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, want, strict=True):
        for token, ref_token, step, ref_step in zip(tokens, ref_tokens, logits, ref_logits, strict=True):
            for t in step.keys() & ref_step.keys():
                assert step[t] == pytest.approx(ref_step[t], abs=atol)
            if token != ref_token:
                assert token in ref_step and ref_step[ref_token] - ref_step[token] <= 2 * atol
                assert ref_token in step and step[token] - step[ref_token] <= 2 * atol
                break


def test_pp2_compiled_in_the_default_dtype_matches_one_rank(models: dict[str, Path], tmp_path: Path) -> None:
    """The default compiled mode and dtype (bf16 where the CPU has native bf16): each stage compiles
    only its own layers, and the native decode path (one call through every layer) steps aside for a
    stage. One eager rank is the reference; the tolerance is what the dtype's rounding does to
    transformers' logits of the same tokens."""
    compiled = {"dtype": "auto", "enforce_eager": False, "compilation_config": {"cache_dir": str(tmp_path)}}
    reference = _llm(models["llama"], dtype="auto")
    dtype = reference.llm_engine.model_config.dtype
    try:
        want = _generate(reference)
    finally:
        reference.llm_engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0] + want[0][0]])
        exact = hf(ids).logits
        atol = 1e-4 if dtype == torch.float32 else dtype_atol(exact, hf.to(dtype)(ids).logits, 1e-4)
    llm = _llm(models["llama"], pipeline_parallel_size=2, distributed_executor_backend="mp", **compiled)
    try:
        assert llm.llm_engine.model_config.dtype == dtype
        got = _generate(llm)
        _assert_same_up_to_a_near_tie(got, want, atol)
    finally:
        llm.llm_engine.shutdown()
