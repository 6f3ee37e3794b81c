"""Gemma 2, Gemma 3, Phi-3, OLMo 2 and Granite against HF transformers on the same tiny random weights
(float32): logits of prefill, decode, chunked prefill and mixed steps over the paged cache within 1e-4,
and greedy tokens of `LLM.generate` (chunked prefill, batched decode) equal to HF's `generate` for 16
steps. Prompts are longer than the 8-token (Gemma) and 24-token (Phi-3) windows and than Phi-3's
32-token pre-training length (its LongRoPE long factors)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from dense_families import FAMILIES, VOCAB, make_family_model
from transformers import PreTrainedModel

from pagedllm import LLM, SamplingParams
from pagedllm.config import CompilationConfig
from pagedllm.forward_context import set_forward_context
from pagedllm.models import load_model
from pagedllm.models.registry import supported_architectures

ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    path = tmp_path_factory.mktemp(request.param)
    return make_family_model(request.param, path), path


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _reference(hf: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


@torch.no_grad()
def _hf_greedy(hf: PreTrainedModel, prompt: list[int], steps: int) -> list[int]:
    """HF's greedy continuation, each step a full forward of the sequence so far (EOS not stopping)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_reference(hf, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_registered(family: tuple[PreTrainedModel, Path]) -> None:
    hf, _ = family
    assert hf.config.architectures[0] in supported_architectures()


def test_paged_steps_match_hf(family: tuple[PreTrainedModel, Path]) -> None:
    hf, path = family
    ours = load_model(hf.config, path)
    seqs = {"a": _tokens(52, 1), "b": _tokens(45, 2), "c": _tokens(60, 3)}
    refs = {r: _reference(hf, s) for r, s in seqs.items()}
    batch = PagedBatch.for_model(ours)
    # a: whole prompt; b: chunked 17 + 13; c: chunked 33 beside b's second chunk and a's decode.
    steps = [
        [("a", 0, 40), ("b", 0, 17)],
        [("b", 17, 30), ("c", 0, 33), ("a", 40, 41)],
        [("c", 33, 50), ("a", 41, 42), ("b", 30, 31)],
    ]
    steps += [[("a", 42 + i, 43 + i), ("b", 31 + i, 32 + i), ("c", 50 + i, 51 + i)] for i in range(9)]
    for step in steps:
        outs = batch.run(ours, [(r, seqs[r][a:b]) for r, a, b in step])
        for (r, a, b), out in zip(step, outs):
            torch.testing.assert_close(out, refs[r][a:b], atol=ATOL, rtol=0, msg=f"{r}[{a}:{b}]")


def test_greedy_generate_matches_hf(family: tuple[PreTrainedModel, Path]) -> None:
    hf, path = family
    prompts = [_tokens(n, 10 + n) for n in (41, 57, 36)]
    llm = LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        optimization_level=0,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(hf, prompt, 16)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    # Every family traces the shared Llama blocks' code: without a reset, these tests and later
    # modules' would together pass Dynamo's recompile limit for those code objects.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_forward_traces_as_one_graph(family: tuple[PreTrainedModel, Path], fresh_dynamo: None) -> None:
    """torch.compile sees the whole forward (and the logits with their soft cap or scaling) with no
    graph break, and the traced model gives HF's logits on a mixed step."""
    hf, path = family
    ours = load_model(hf.config, path)
    forward = torch.compile(ours, backend="eager", fullgraph=True, dynamic=True)
    logits_fn = torch.compile(ours.compute_logits, backend="eager", fullgraph=True)
    prompt = _tokens(45, 9)
    ref = _reference(hf, prompt)
    batch = PagedBatch.for_model(ours)
    batch.run(ours, [("x", prompt[:33])])
    chunks = [("x", prompt[33:34]), ("y", prompt[:12])]
    positions, md = batch.metadata([(r, len(t)) for r, t in chunks])
    ids = torch.tensor([t for _, toks in chunks for t in toks])
    with torch.no_grad(), set_forward_context(md):
        logits = logits_fn(forward(ids, positions))
    torch.testing.assert_close(logits[0], ref[33], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1:], ref[:12], atol=ATOL, rtol=0)


def test_bfloat16_model_and_cache(family: tuple[PreTrainedModel, Path]) -> None:
    """bfloat16 weights, activations and KV cache stay within 5% of the logit range of HF float32."""
    hf, path = family
    ours = load_model(hf.config, path, dtype=torch.bfloat16)
    prompt = _tokens(40, 10)
    batch = PagedBatch.for_model(ours, dtype=torch.bfloat16)
    got = torch.cat([*batch.run(ours, [("r", prompt[:39])]), *batch.run(ours, [("r", prompt[39:])])])
    ref = _reference(hf, prompt)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=0.05 * ref.abs().max().item(), rtol=0)


def test_compiled_greedy_generate_matches_hf(family: tuple[PreTrainedModel, Path], tmp_path: Path) -> None:
    """The compiled forward (O1: each decoder layer traced per shape class, here with the eager backend
    so no Inductor build runs) gives HF's greedy tokens: the compiled path finds each family's decoder
    layers (`decoder_layers()`) whatever its body."""
    hf, path = family
    # Longer than Phi-3's pre-training length (32): HF picks LongRoPE's short factors below it, the
    # engine one set for its whole context (as in the eager test above).
    prompts = [_tokens(n, 20 + n) for n in (41, 36)]
    llm = LLM(
        model=str(path),
        dtype="float32",
        optimization_level=1,
        compilation_config=CompilationConfig(backend="eager", custom_ops=["none"], cache_dir=str(tmp_path / "cc")),
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(hf, prompt, 8)
