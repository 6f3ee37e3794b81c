"""End to end on a tiny random Llama: greedy outputs equal transformers' and stay identical whatever the
engine does underneath (prefix caching on/off, chunk sizes, KV pressure forcing preemption, batch size,
sequence limit); n > 1, stop strings and seeded sampling behave."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tiny_llm import hf_greedy, make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.config.args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

# float32 for exact comparisons; eager to keep start-up short; a small KV budget each.
BASE: dict[str, Any] = dict(
    dtype="float32",
    max_model_len=256,
    enforce_eager=True,
    optimization_level=0,
    kv_cache_memory_bytes=8 << 20,
)
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), **BASE)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """Eight prompts sharing a 40-token prefix (prefix-cache hits) of assorted lengths, plus two unrelated."""
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    out += [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 61)]
    return out


@pytest.fixture(scope="module")
def reference(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_transformers(
    model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert reference == hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 37, "enable_prefix_caching": False},
        {"max_num_batched_tokens": 64, "max_num_seqs": 3},
        {"block_size": 32, "max_num_batched_tokens": 50},
    ],
    ids=["no-prefix-cache", "chunk16", "chunk37-no-cache", "chunk64-seqs3", "block32-chunk50"],
)
def test_identical_under_engine_settings(
    model_dir: Path, prompts: list[list[int]], reference: list[list[int]], engine_kwargs: dict[str, Any]
) -> None:
    llm = LLM(model=str(model_dir), **{**BASE, **engine_kwargs})
    assert greedy_tokens(llm, prompts) == reference
    # A second pass runs on a warm prefix cache (when enabled): still the same tokens.
    assert greedy_tokens(llm, prompts) == reference


def test_identical_under_preemption(
    model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # 20 blocks of 16 tokens hold one full-length sequence but not the ten prompts at once.
    args = EngineArgs(
        model=str(model_dir), **{**BASE, "num_gpu_blocks_override": 20, "max_num_batched_tokens": 32}
    )
    engine = LLMEngine.from_engine_args(args)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    tokens: dict[str, list[int]] = {}
    preemptions = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        if engine.scheduler_stats is not None:
            preemptions = max(preemptions, engine.scheduler_stats.num_preemptions)
    assert preemptions > 0, "the KV budget was meant to force preemption"
    assert [tokens[str(i)] for i in range(len(prompts))] == reference


def test_seeded_request_resumes_its_random_stream_after_preemption(
    llm: LLM, model_dir: Path, prompts: list[list[int]]
) -> None:
    # 5 blocks of 16: a long greedy request (40 + 20 tokens) and a short seeded one cannot both grow,
    # and the seeded one, admitted last, is the fcfs victim.
    args = EngineArgs(
        model=str(model_dir),
        **{**BASE, "max_model_len": 64, "num_gpu_blocks_override": 5, "max_num_batched_tokens": 32},
    )
    engine = LLMEngine.from_engine_args(args)
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 5 + 16 tokens: the seeded request needs a second block while the long one holds the other four.
    seeded = SamplingParams(temperature=3.0, seed=4321, max_tokens=16, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": prompts[9][:40]}, long)
    engine.add_request("seeded", {"prompt_token_ids": prompts[8]}, seeded)
    scheduler = engine.engine_core.core.scheduler  # type: ignore[attr-defined]
    tokens: dict[str, list[int]] = {}
    seeded_preemptions = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        if "seeded" in scheduler.requests:
            seeded_preemptions = scheduler.requests["seeded"].num_preemptions
    assert seeded_preemptions > 0, "the seeded request was meant to be preempted"
    # The runner keeps a seeded request's generator across preemption: same draws as on its own.
    alone = llm.generate({"prompt_token_ids": prompts[8]}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["seeded"] == alone
    assert len(set(alone)) > 1


def test_stop_token_ids_and_min_tokens(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    greedy = reference[4]
    stop_id = greedy[2]
    k = greedy.index(stop_id)  # its first appearance
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id])
    (stopped,) = llm.generate({"prompt_token_ids": prompts[4]}, params, use_tqdm=False)
    completion = stopped.outputs[0]
    # The stop token is kept in token_ids and reported as the stop reason.
    assert completion.token_ids == greedy[: k + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
    # Below min_tokens the stop token can be neither sampled nor end the request.
    min_tokens = k + 3
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id], min_tokens=min_tokens
    )
    (late,) = llm.generate({"prompt_token_ids": prompts[4]}, params, use_tqdm=False)
    tokens = late.outputs[0].token_ids
    assert tokens[:k] == greedy[:k] and len(tokens) >= min_tokens
    assert stop_id not in tokens[:min_tokens]
    if late.outputs[0].finish_reason == "stop":
        assert tokens[-1] == stop_id and stop_id not in tokens[:-1]
    else:
        assert late.outputs[0].finish_reason == "length" and len(tokens) == MAX_TOKENS


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_batch_size_does_not_change_outputs(llm: LLM, batch_size: int) -> None:
    rng = random.Random(batch_size)
    vocab = llm.get_tokenizer().vocab_size
    batch = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(batch_size)]
    together = greedy_tokens(llm, batch)
    # Alone, one at a time (only a sample for the large batch, to keep the runtime modest).
    for index in sorted(rng.sample(range(batch_size), min(batch_size, 6))):
        assert greedy_tokens(llm, [batch[index]]) == [together[index]]


def test_n_greedy_children_are_identical(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS)
    (output,) = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(c.token_ids == reference[0] for c in output.outputs)


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM, prompts: list[list[int]]) -> None:
    # A high temperature flattens the tiny model's peaked distribution, so samples really differ.
    seeded = SamplingParams(temperature=3.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    other = SamplingParams(temperature=3.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    target = {"prompt_token_ids": prompts[1]}
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [{"prompt_token_ids": p} for p in prompts[2:7]]
    mixed = llm.generate(
        [*crowd[:2], target, *crowd[2:]], [other, other, seeded, other, other, other], use_tqdm=False
    )
    assert mixed[2].outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=3.0, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert llm.generate(target, reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_sampled_children_differ_and_reproduce(llm: LLM, prompts: list[list[int]]) -> None:
    params = SamplingParams(n=4, temperature=3.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompts[3]}, params, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompts[3]}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert all(len(c.token_ids) == MAX_TOKENS and c.finish_reason == "length" for c in first.outputs)


def _ascii_window(text: str, width: int = 3) -> str | None:
    """A printable-ASCII substring of ``text`` that starts after its first few characters."""
    for start in range(2, len(text) - width):
        window = text[start : start + width]
        if all(32 < ord(ch) < 127 for ch in window):
            return window
    return None


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm: LLM, include: bool) -> None:
    prompts = ["The quick brown fox", "Hello, world!", "Numbers: 0 1 2", "Continuous batching mixes"]
    full = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    candidates = [(p, o.outputs[0].text, _ascii_window(o.outputs[0].text)) for p, o in zip(prompts, full)]
    prompt, text, stop = next((c for c in candidates if c[2] is not None), (None, None, None))
    assert stop is not None and text is not None, f"no ASCII text to stop on in {[c[1] for c in candidates]}"
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop, "never-appears"],
        include_stop_str_in_output=include,
    )
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    completion = output.outputs[0]
    cut = text.find(stop) + (len(stop) if include else 0)
    assert completion.text == text[:cut]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < 24
    # The stop string aborted the request in the core: nothing is left running there.
    assert not llm.llm_engine.engine_core.has_unfinished_requests()
