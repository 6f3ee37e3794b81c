"""Speculative decoding through the offline stack on a tiny random Llama (float32, eager): greedy
outputs and logprobs token-for-token identical to the engine without speculation for every method,
with prefix caching on and off, forced preemption and several prefill chunk sizes; stop strings,
n > 1 and seeds; the sampled output distribution matches the engine without speculation. At the
machine's default dtype and optimization level n-gram and suffix greedy outputs equal the plain
engine's too (bitwise logprobs where that default is bfloat16 with the batch-invariant kernels). And
the runner alone, driving a scripted `Proposer` (no model)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from distribution_check import same_distribution_pvalue
from invariance import HEAD32, assert_same, choices
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.core.sched_output import NewRequestData
from pagedllm.kv_cache_interface import KVCacheSpec
from pagedllm.models.native import llama_decode
from pagedllm.spec_decode.proposer import DraftRequest, TargetStep
from pagedllm.spec_decode.proposers import PROPOSERS, make_proposer
from pagedllm.spec_decode.runner import SpecDecodeRunner
from pagedllm.worker.input_batch import InputBatch

# Repetitive prompts: the tiny model's greedy output loops, so the drafters find matches.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? Hello, world! How are",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Numbers: 0 1 2 3",
    "Paged attention stores keys",
]
SPECS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True, **kwargs)


def _run(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[str] = PROMPTS) -> list[Any]:
    return llm.generate(prompts, params, use_tqdm=False)


def _tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    return _run(_llm(model_dir), params)


def _accepted(llm: LLM) -> tuple[int, int]:
    """The last step's drafted and accepted tokens."""
    stats = llm.llm_engine.scheduler_stats
    return (0, 0) if stats is None else (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)


@pytest.mark.parametrize("method", sorted(SPECS))
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": False},
        # 8 blocks of 16 tokens for 4 sequences of up to ~80 tokens: requests get preempted.
        {"num_gpu_blocks_override": 17, "block_size": 16},
        {"max_num_batched_tokens": 16, "enable_chunked_prefill": True},
        {"max_num_batched_tokens": 40, "enable_chunked_prefill": True},
    ],
    ids=["prefix-caching", "no-prefix-caching", "preemption", "chunk16", "chunk40"],
)
def test_greedy_identical_to_plain(
    model_dir: Path, reference: list[Any], method: str, engine_kwargs: dict[str, Any]
) -> None:
    llm = _llm(model_dir, speculative_config=SPECS[method], **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    drafted = accepted = 0
    original_step = llm.llm_engine.step

    def step() -> Any:
        nonlocal drafted, accepted
        out = original_step()
        d, a = _accepted(llm)
        drafted, accepted = drafted + d, accepted + a
        return out

    llm.llm_engine.step = step  # type: ignore[method-assign]
    outputs = _run(llm, params)
    assert _tokens(outputs) == _tokens(reference)
    # Accepted drafts (KV of drafted positions kept) and rejected ones (rolled back) must both occur.
    # The random model's drafts are mostly rejected, so the draft control verifies few of them (6
    # accepted here, where drafting every step accepted more than 8).
    assert accepted >= 4 and drafted > accepted, (
        f"{accepted} of {drafted} drafts accepted: the test would not exercise verification"
    )
    for ours, ref in zip(outputs, reference):
        for mine, theirs in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            for token, lp in mine.items():
                assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
                assert lp.rank == theirs[token].rank


def test_stop_strings_penalties_and_n(model_dir: Path) -> None:
    plain = _llm(model_dir)
    spec = _llm(model_dir, speculative_config=SPECS["ngram"])
    ref = _run(plain, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    text = ref[0].outputs[0].text
    # A stop string inside the output: the request ends there with or without speculation.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, min_tokens=30, n=2),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, frequency_penalty=0.5),
    ]
    want = _run(plain, params)
    got = _run(spec, params)
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in want]
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]


def test_seeds_reproduce(model_dir: Path) -> None:
    # n-gram drafts depend on the request's own tokens only (suffix decoding's global trie also learns
    # from earlier requests, so its drafts, and with them the random draws, change from run to run).
    llm = _llm(model_dir, speculative_config=SPECS["ngram"])
    params = SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=30, n=2)
    first = _tokens(_run(llm, params))
    assert _tokens(_run(llm, params)) == first
    assert _tokens(_run(llm, SamplingParams(temperature=0.9, top_k=20, seed=12, max_tokens=30, n=2))) != first


def test_sampled_distribution_matches_plain(model_dir: Path) -> None:
    """(`strict` is checked on the sampler itself, tests/sample/test_rejection_sampler.py.) Two-sample chi-square on the joint distribution of the first three sampled tokens (top-k 3 keeps
    27 cells) of many requests, with and without speculation."""
    prompt = ["Hello, world! Hello, world! Hello, world! Hello,"]
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True, n=600)
    spec = dict(SPECS["ngram"], prompt_lookup_min=1, rejection_sample_method="standard")

    def histogram(llm: LLM) -> dict[tuple[int, ...], int]:
        counts: dict[tuple[int, ...], int] = {}
        for _ in range(2):
            for c in _run(llm, params, prompt)[0].outputs:
                key = tuple(c.token_ids)
                counts[key] = counts.get(key, 0) + 1
        return counts

    plain = histogram(_llm(model_dir, max_num_seqs=8))
    llm = _llm(model_dir, max_num_seqs=8, speculative_config=spec)
    ours = histogram(llm)
    assert same_distribution_pvalue(plain, ours) > 1e-3


@pytest.mark.skipif(
    not llama_decode.supports_dtype(torch.float32),
    reason="the native decode path of float32 weights needs a C compiler and AVX-512 or AVX2 + FMA",
)
def test_compiled_verification_runs_natively_and_matches_plain(model_dir: Path, tmp_path: Path) -> None:
    """At the compiled default a step verifying drafts (1 + k tokens of one request) runs in the
    native one-call body, as one-token steps do; greedy outputs stay those of the engine without
    speculation."""
    served: list[tuple[int, bool]] = []
    original_call = llama_decode.LlamaNativeDecoder.__call__

    def counting(self: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        out = original_call(self, input_ids, positions)
        served.append((input_ids.shape[0], out is not None))
        return out

    def compiled(**kwargs: Any) -> LLM:
        return LLM(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            compilation_config={"cache_dir": str(tmp_path / "compile-cache")},
            **kwargs,
        )

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_decode.LlamaNativeDecoder, "__call__", counting)
        want = _tokens(_run(compiled(), params))
        spec = compiled(speculative_config=SPECS["ngram"])
        served.clear()  # the start-up's warm-up runs (without attention metadata) use the graphs
        got = _tokens(_run(spec, params))
    assert got == want
    # Every step of decode rows only (all but the prompts') ran natively, verifications among them.
    assert any(rows > 1 for rows, _ in served) and all(ok for _, ok in served), served


class _ScriptedProposer:
    """A `Proposer` that drafts `script[req_id]` and records every call: the runner must drive it
    through the protocol alone (no method names, no concrete classes)."""

    aux_hidden_layers: list[int] = []

    def __init__(self, shadow_drafts: bool, script: dict[str, list[int]]) -> None:
        self.shadow_drafts = shadow_drafts
        self.script = script
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[str, Any]] = []

    def load_model(self, target: Any) -> None:
        self.calls.append(("load_model", target))

    def kv_cache_spec(self, kv_cache_dtype: torch.dtype) -> KVCacheSpec | None:
        return KVCacheSpec(block_size=16, num_kv_heads=[1], head_size=[8], dtype=kv_cache_dtype)

    def initialize_kv_cache(self, num_blocks: int, kv_cache_dtype: torch.dtype) -> None:
        self.calls.append(("initialize_kv_cache", num_blocks))

    def release_kv_cache(self) -> int:
        return 123

    def observe(self, step: TargetStep) -> None:
        self.calls.append(("observe", step))

    def propose(self, batch: Any, requests: list[DraftRequest]) -> dict[str, list[int]]:
        self.calls.append(("propose", [(r.req_id, r.num_drafts, r.num_verified) for r in requests]))
        return {r.req_id: self.script[r.req_id][: r.num_drafts] for r in requests}

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None:
        self.calls.append(("forget", (req_id, None if output_token_ids is None else output_token_ids.tolist())))


def _scripted_runner(
    monkeypatch: pytest.MonkeyPatch, proposer: _ScriptedProposer, k: int = 3
) -> tuple[SpecDecodeRunner, InputBatch]:
    monkeypatch.setitem(PROPOSERS, "ngram", lambda cfg, loaders: proposer)
    cfg = SimpleNamespace(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=k))
    runner = SpecDecodeRunner(cfg, max_num_reqs=4, max_model_len=64, loaders=None)  # type: ignore[arg-type]
    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_blocks_per_req=4)
    for req_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        batch.add_request(NewRequestData(req_id, prompt, len(prompt), SamplingParams(max_tokens=20), [0], 0))
    return runner, batch


def _end_step(runner: SpecDecodeRunner, batch: InputBatch, req_ids: list[str]) -> None:
    rows = np.asarray([batch.req_id_to_row[r] for r in req_ids])
    qsl = np.arange(len(req_ids) + 1)
    runner.end_step(req_ids, rows, qsl, np.arange(len(req_ids)), torch.zeros(len(req_ids), 8), [], batch)


def test_runner_drives_a_proposer_through_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = _ScriptedProposer(shadow_drafts=False, script={"a": [7, 8, 9], "b": [6, 6, 6]})
    runner, batch = _scripted_runner(monkeypatch, proposer)
    runner.load_model("target")  # type: ignore[arg-type]
    assert proposer.calls.pop() == ("load_model", "target")
    # The target's share of the cache budget comes from the proposer's block (2 x 16 x 8 x 4 bytes).
    assert runner.kv_cache_share(1024, torch.float32) == pytest.approx(1024 / (1024 + 1024))
    assert runner.release_kv_cache() == 123
    _end_step(runner, batch, ["a", "b"])
    kind, step = proposer.calls.pop()
    assert kind == "observe" and step.req_ids == ["a", "b"] and step.hidden.shape == (2, 8)
    # A model drafter (no shadows) drafts at least one token per request while the batch allows any.
    drafts = runner.propose(batch, {})
    assert proposer.calls.pop() == ("propose", [("a", 3, 3), ("b", 3, 3)])
    assert drafts == {"a": [7, 8, 9], "b": [6, 6, 6]}
    # Drafting switched off (a batch too large for one draft each): the proposer is still called, with
    # no requests, after observing the step (an EAGLE head must read every step's hidden states).
    runner.draft_length.max_step_tokens = 2
    _end_step(runner, batch, ["a", "b"])
    assert runner.propose(batch, {}) == {}
    assert [c[0] for c in proposer.calls[-2:]] == ["observe", "propose"] and proposer.calls[-1][1] == []
    # A finished request hands its output over; a preempted one hands nothing (it resumes elsewhere).
    batch.append_sampled_tokens(np.asarray([batch.req_id_to_row["a"]]), np.asarray([42]))
    runner.forget(batch, "a")
    runner.preempted("b")
    assert proposer.calls[-2:] == [("forget", ("a", [42])), ("forget", ("b", None))]


def test_runner_verifies_only_the_drafts_that_pay_and_scores_shadows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token drafter is asked for a full shadow draft while a request verifies nothing; the runner
    returns only the verified ones."""
    proposer = _ScriptedProposer(shadow_drafts=True, script={"a": [7, 8, 9], "b": [6, 6, 6]})
    runner, batch = _scripted_runner(monkeypatch, proposer)
    # "b"'s drafts were all rejected, over and over: it verifies none, drafts shadows of k.
    for _ in range(8):
        runner.control.record("b", [6, 6, 6], 2)
        runner.control.requests["b"].observe(0, 3)
        runner.control.requests["b"].pending = None
    _end_step(runner, batch, ["a", "b"])
    drafts = runner.propose(batch, {})
    assert proposer.calls[-1] == ("propose", [("a", 3, 3), ("b", 3, 0)])
    assert drafts == {"a": [7, 8, 9]}
    assert runner.control.requests["b"].pending == [6, 6, 6]


def test_unknown_method_names_the_drafters() -> None:
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="medusa"))
    with pytest.raises(ValueError, match="method='medusa' has no drafter.*ngram"):
        make_proposer(cfg, None)  # type: ignore[arg-type]


def test_greedy_identical_to_plain_at_the_default_dtype(tmp_path: Path) -> None:
    """bfloat16 where `dtype=auto` picks it: verification rows are computed as decode rows are, so
    the drafts cannot change the output (they did on 1 of 4 prompts before the batch-invariant
    kernels)."""
    # (Seed 1: a model whose greedy outputs repeat enough for drafts to be accepted.)
    model = make_tiny_llm(tmp_path / "tiny_llm", seed=1, **HEAD32)

    def llm(**kwargs: Any) -> LLM:
        cache = {"cache_dir": str(tmp_path / "compile-cache")}
        return LLM(model=str(model), max_model_len=256, compilation_config=cache, **kwargs)

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    want = choices(_run(llm(), params))
    for method, spec in SPECS.items():
        engine = llm(speculative_config=spec)
        drafted = _counting_drafts(engine)
        assert_same(choices(_run(engine, params)), want)
        # A verification step's rows give the output whether its drafts are accepted or not.
        assert drafted[0] > 0, f"{method}: nothing drafted, the test would not exercise verification"


def _counting_drafts(llm: LLM) -> list[int]:
    """[drafted tokens], counted over the engine's steps from now on."""
    drafted = [0]
    original_step = llm.llm_engine.step

    def step() -> Any:
        out = original_step()
        drafted[0] += _accepted(llm)[0]
        return out

    llm.llm_engine.step = step  # type: ignore[method-assign]
    return drafted
