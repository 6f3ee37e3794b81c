"""Draft-model speculative decoding through the offline stack, on tiny random Llamas written here with
the same tokenizer: greedy outputs token-for-token identical to the engine without speculation (prefix
caching on and off, chunked prefill, forced preemption), a draft with the target's own weights has
every draft accepted (the bookkeeping check: any stale or misplaced draft KV would cost acceptances),
and sampled outputs keep the target's distribution when the drafts are sampled too."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from distribution_check import same_distribution_pvalue
from proposal_recorder import record_proposals
from tiny_llm import make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello, world! How are you today?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Numbers: 0 1 2 3",
    "Paged attention stores keys",
]
NOISE = 0.03
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def twin_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft model with the target's weights."""
    path = tmp_path_factory.mktemp("twin") / "model"
    shutil.copytree(target_dir, path)
    return path


@pytest.fixture(scope="module")
def noisy_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's weights with noise on its MLPs: a draft that is right often, not always."""
    path = tmp_path_factory.mktemp("noisy") / "model"
    shutil.copytree(target_dir, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.add_(torch.randn(param.shape, generator=generator) * NOISE)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random draft (other head counts and depth: its own cache shapes)."""
    return make_tiny_llm(
        tmp_path_factory.mktemp("small"),
        seed=1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def _llm(
    model_dir: Path, draft: Path | None = None, k: int = 3, spec: dict[str, Any] | None = None, **kwargs: Any
) -> LLM:
    if draft is not None:
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": k,
            **(spec or {}),
        }
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, **kwargs)


def _tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def _generate_counting(llm: LLM, params: SamplingParams, prompts: list[str]) -> tuple[list[Any], dict[str, int]]:
    """The outputs, and over the run the draft tokens verified and accepted (the spec metrics) and
    the preemptions."""
    counts = {"drafted": 0, "accepted": 0, "preemptions": 0}
    original_step = llm.llm_engine.step

    def step() -> Any:
        out = original_step()
        stats = llm.llm_engine.scheduler_stats
        if stats is not None:
            counts["drafted"] += stats.spec_num_draft_tokens
            counts["accepted"] += stats.spec_num_accepted_tokens
            counts["preemptions"] += stats.num_preemptions
        return out

    llm.llm_engine.step = step  # type: ignore[method-assign]
    return llm.generate(prompts, params, use_tqdm=False), counts


@pytest.fixture(scope="module")
def reference(target_dir: Path) -> list[Any]:
    return _llm(target_dir).generate(PROMPTS, GREEDY, use_tqdm=False)


ENGINE_KWARGS = {
    "prefix-caching": {"enable_prefix_caching": True},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunk16": {"max_num_batched_tokens": 16, "enable_chunked_prefill": True, "enable_prefix_caching": True},
    # 10 blocks of 16 tokens for 4 sequences of up to ~60 tokens (+ lookahead): requests get preempted.
    "preemption": {"num_gpu_blocks_override": 10, "block_size": 16},
}


@pytest.mark.parametrize("draft", ["twin", "small"])
@pytest.mark.parametrize("engine", sorted(ENGINE_KWARGS))
def test_greedy_identical_to_plain(
    target_dir: Path, twin_dir: Path, small_dir: Path, reference: list[Any], draft: str, engine: str
) -> None:
    llm = _llm(target_dir, twin_dir if draft == "twin" else small_dir, **ENGINE_KWARGS[engine])
    outputs, counts = _generate_counting(llm, GREEDY, PROMPTS)
    assert _tokens(outputs) == _tokens(reference)
    for ours, ref in zip(outputs, reference):
        for mine, theirs in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            for token, lp in mine.items():
                assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    assert counts["drafted"] > 40, "hardly anything was drafted: the test would not exercise the drafter"
    assert (counts["preemptions"] > 0) == (engine == "preemption")
    if draft == "twin":
        # The target's own weights draft exactly what the target emits: every draft is accepted.
        assert counts["accepted"] == counts["drafted"]


def test_twin_accepts_everything_again_on_prefix_hits(target_dir: Path, twin_dir: Path) -> None:
    """The second run of the same prompts hits the prefix cache: the draft cache of those blocks must
    still be right (the draft recomputes them), so every draft is still accepted."""
    llm = _llm(target_dir, twin_dir, k=4, enable_prefix_caching=True, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first, counts = _generate_counting(llm, params, PROMPTS)
    assert counts["accepted"] == counts["drafted"] > 0
    again, counts = _generate_counting(llm, params, PROMPTS)
    assert _tokens(again) == _tokens(first)
    assert counts["accepted"] == counts["drafted"] > 0


# Up to 2 running requests draft 3 tokens, 3-4 none, 5-32 two: as the 20 requests of the test finish,
# drafting stops for a while, and the KV of drafts written before goes stale (the tokens moved on).
SCHEDULE = {"num_speculative_tokens_per_batch_size": {2: 3, 4: 0, 32: 2}}


@pytest.mark.parametrize("engine", ["preemption", "chunk16", "prefix-caching"])
def test_drafts_are_the_draft_models_own_greedy_continuation(
    target_dir: Path, noisy_dir: Path, engine: str
) -> None:
    """Each proposal of a greedy request is what the draft model (transformers, from scratch) continues
    the request's sequence with. The noisy draft's drafts are partly rejected: a stale draft KV entry (a
    rejected draft's, a preempted request's old blocks, a prefix hit the draft never computed, drafts
    written before a stretch of steps without drafting) would change them."""
    llm = _llm(target_dir, noisy_dir, k=3, spec=SCHEDULE, max_num_seqs=32, **ENGINE_KWARGS[engine])
    proposals = record_proposals(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True) for i in range(20)]
    outputs, counts = _generate_counting(llm, params, PROMPTS * 5)
    assert 0 < counts["accepted"] < counts["drafted"], "the drafts must be partly rejected"
    hf = AutoModelForCausalLM.from_pretrained(noisy_dir, dtype=torch.float32).eval()
    assert len(proposals) > 50
    with torch.no_grad():
        for tokens, drafts in proposals:
            out = hf.generate(torch.tensor([tokens]), max_new_tokens=len(drafts), do_sample=False)
            assert out[0, len(tokens) :].tolist() == drafts


def test_sampled_drafts_keep_the_target_distribution(target_dir: Path, small_dir: Path) -> None:
    """Drafts sampled from the draft model (draft_sample_method='probabilistic') are verified with
    min(1, p/q): two-sample chi-square on the joint distribution of the first three tokens."""
    prompt = ["Hello, world! Hello, world! Hello,"]
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True, n=500)

    def histogram(llm: LLM) -> dict[tuple[int, ...], int]:
        counts: dict[tuple[int, ...], int] = {}
        for _ in range(2):
            for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs:
                counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
        return counts

    plain = histogram(_llm(target_dir, max_num_seqs=8))
    ours = histogram(_llm(target_dir, small_dir, k=2, max_num_seqs=8))
    assert same_distribution_pvalue(plain, ours) > 1e-3


def test_seeded_requests_reproduce(target_dir: Path, small_dir: Path) -> None:
    llm = _llm(target_dir, small_dir)
    params = SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=20, n=2)
    first = _tokens(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    assert _tokens(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == first


def test_sleep_releases_the_draft_cache_and_wakes_up(target_dir: Path, twin_dir: Path) -> None:
    llm = _llm(target_dir, twin_dir, enable_sleep_mode=True)
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    drafter = llm.llm_engine.engine_core.core.model_executor.driver_worker.runner.spec.proposer
    llm.sleep(level=1)
    assert drafter.kv_caches == []
    llm.wake_up()
    outputs, counts = _generate_counting(llm, GREEDY, PROMPTS)
    assert _tokens(outputs) == want
    assert counts["accepted"] == counts["drafted"] > 0
