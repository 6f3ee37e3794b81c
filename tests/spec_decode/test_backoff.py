"""The cheap drafters' back-off (`pagedllm.spec_decode.backoff`): the rule on its own (pauses, their
doubling up to the cap, the reset after a successful probe), and through the offline stack on a tiny
random Llama with a scripted drafter whose drafts are right or wrong on purpose: greedy outputs stay
token-identical to no speculation, a request whose drafts always fail stops drafting, and one whose
drafts are always accepted drafts every step (counted with the spec_decode metrics counters)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.backoff import (
    COST_CLIP,
    FIRST_PAUSE,
    MAX_PAUSE,
    VERIFY_OVERHEAD,
    DraftBackoff,
    VerifyCost,
    expected_gain,
)


def _run_rule(backoff: DraftBackoff, steps: int, accept: Callable[[int], bool], k: int = 4) -> list[int]:
    """Draft lengths of one request over ``steps`` steps; step i's drafts are all accepted when
    accept(i), else all rejected."""
    lengths = []
    for i in range(steps):
        n = backoff.num_drafts("r", k)
        if n:
            backoff.observe("r", n, n if accept(i) else 0)
        lengths.append(n)
    return lengths


def _pauses(lengths: list[int]) -> list[int]:
    """The lengths of the runs of steps that drafted nothing."""
    runs, current = [], 0
    for n in lengths:
        if n == 0:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs + ([current] if current else [])


def test_expected_gain() -> None:
    assert expected_gain(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_gain(1.0, 4) == 4
    assert expected_gain(0.9, 0) == 0


def test_failing_drafts_pause_doubling_up_to_the_cap() -> None:
    lengths = _run_rule(DraftBackoff(pausing=True), 200, lambda i: False)
    # Acceptance 1 -> 1/2 -> 1/4: 4 drafts, then 2, then 1 would gain 0.25 < 0.3: the first pause.
    assert lengths[:3] == [4, 2, 0]
    # Between the pauses, one-token probes that fail.
    assert [n for n in lengths if n] == [4, 2] + [1] * (len(_pauses(lengths)) - 1)
    assert _pauses(lengths)[:6] == [FIRST_PAUSE, 8, 16, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE]


def test_successful_probe_resets_the_pause() -> None:
    backoff = DraftBackoff(pausing=True)
    # Failing until the pauses reach 16 steps (step 32 is the probe after it), that probe accepted,
    # then failing again: the next pause is the first pause's length again.
    lengths = _run_rule(backoff, 60, lambda i: i == 32)
    assert lengths[32] == 1
    assert _pauses(lengths)[:4] == [FIRST_PAUSE, 8, 16, FIRST_PAUSE]


def test_accepted_drafts_keep_drafting_and_model_drafters_never_pause() -> None:
    assert _run_rule(DraftBackoff(pausing=True), 50, lambda i: True) == [4] * 50
    # Without pausing only the length follows the acceptance (at least 1 token).
    assert _run_rule(DraftBackoff(pausing=False), 10, lambda i: False) == [4, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    backoff = DraftBackoff(pausing=True)
    assert backoff.num_drafts("r", 0) == 0
    # A step where the drafter found nothing (no verification) leaves the request probing.
    _run_rule(backoff, 3, lambda i: False)
    assert [backoff.num_drafts("r", 4) for _ in range(FIRST_PAUSE)] == [0, 0, 0, 1]
    assert backoff.num_drafts("r", 4) == 1
    backoff.forget("r")
    assert backoff.num_drafts("r", 4) == 4


def test_verify_cost_measures_the_overhead_per_batch_size() -> None:
    cost = VerifyCost()
    cost.observe(1, False, 0.10)
    assert cost.overhead(1) == VERIFY_OVERHEAD  # until both kinds of step are timed
    cost.observe(1, True, 0.25)
    assert cost.overhead(1) == pytest.approx(1.5)
    assert cost.overhead(2) == VERIFY_OVERHEAD
    # A step far slower than the average so far (a shape compiling) counts as COST_CLIP x the average.
    before = cost.verify[1]
    cost.observe(1, True, 100.0)
    assert cost.verify[1] == pytest.approx(before + 0.1 * (COST_CLIP - 1) * before)
    # Verification as cheap as a plain step: no overhead (never negative).
    cheap = VerifyCost()
    cheap.observe(3, False, 0.2)
    cheap.observe(3, True, 0.1)
    assert cheap.overhead(3) == 0.0


# --- Through the engine -------------------------------------------------------------------------------

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention stores keys", "Hello, world!"]
MAX_TOKENS = 48


class ScriptedProposer:
    """Drafts the greedy reference continuation where ``right(position)``, else tokens that differ
    from it at every position (so the first draft is rejected)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], right: Callable[[int], bool]) -> None:
        self.sequences = [(np.asarray(p), o) for p, o in zip(prompts, outputs)]
        self.right = right

    def propose(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        for prompt, output in self.sequences:
            if token_ids.size >= prompt.size and np.array_equal(token_ids[: prompt.size], prompt):
                pos = token_ids.size - prompt.size
                want = output[pos : pos + k]
                return want if self.right(pos) else [t + 1 for t in want]
        raise AssertionError("a sequence the script does not know")

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True, **kwargs)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    outputs = _llm(model_dir).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outputs], [list(o.outputs[0].token_ids) for o in outputs]


def _scripted_run(
    model_dir: Path, reference: tuple[list[list[int]], list[list[int]]], right: Callable[[int], bool],
    prompts: list[str] = PROMPTS,
) -> tuple[list[list[int]], dict[str, int]]:
    """Outputs of the prompts with the scripted drafter, and the spec_decode counters summed over the
    steps (drafts = verifications, draft_tokens = extra verification rows) with the steps run."""
    llm = _llm(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    spec = llm.llm_engine.engine_core.core.model_executor.driver_worker.runner.spec
    spec.proposer = ScriptedProposer(*reference, right)
    spec.cost = None  # no timing: the overhead stays VERIFY_OVERHEAD (step times on busy cores vary)
    counts = {"steps": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0}
    original_step = llm.llm_engine.step

    def step() -> Any:
        out = original_step()
        stats = llm.llm_engine.scheduler_stats
        counts["steps"] += 1
        if stats is not None:
            counts["drafts"] += stats.spec_num_drafts
            counts["draft_tokens"] += stats.spec_num_draft_tokens
            counts["accepted"] += stats.spec_num_accepted_tokens
        return out

    llm.llm_engine.step = step  # type: ignore[method-assign]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], counts


def test_greedy_identical_with_backoff_active(model_dir: Path, reference: Any) -> None:
    # Wrong drafts for the first 12 positions: each request drafts 4, then 2, pauses 4 steps, probes
    # (wrong), pauses 8 steps; its probe at position 16 is right, and it drafts on to the end.
    outputs, counts = _scripted_run(model_dir, reference, lambda pos: pos >= 12)
    assert outputs == reference[1]
    assert counts["draft_tokens"] - counts["accepted"] <= 3 * (4 + 2 + 1 + 1), counts
    assert counts["accepted"] >= 3 * 16, counts


def test_always_rejected_stops_drafting(model_dir: Path, reference: Any) -> None:
    outputs, counts = _scripted_run(model_dir, reference, lambda pos: False, PROMPTS[:1])
    assert outputs == reference[1][:1]
    assert counts["accepted"] == 0
    # 47 decode steps: 4 and 2 drafts, then pauses of 4, 8 and 16 steps with one-token probes between
    # (without the back-off: a verification every step).
    assert counts["drafts"] <= 6, counts
    assert counts["draft_tokens"] <= 4 + 2 + 4, counts


def test_always_accepted_keeps_drafting(model_dir: Path, reference: Any) -> None:
    outputs, counts = _scripted_run(model_dir, reference, lambda pos: True, PROMPTS[:1])
    assert outputs == reference[1][:1]
    # Every decode step (all but the prefill step) verified drafts and accepted them all: 4 a step
    # (fewer at the end, within max_tokens), so 47 tokens after the first in 10 steps.
    assert counts["drafts"] == counts["steps"] - 1 == 10, counts
    assert counts["accepted"] == counts["draft_tokens"] == MAX_TOKENS - 1 - counts["drafts"], counts


def test_the_runner_times_plain_and_verifying_steps(model_dir: Path) -> None:
    llm = _llm(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    spec = llm.llm_engine.engine_core.core.model_executor.driver_worker.runner.spec
    llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    # One request: its decode steps with and without drafts were timed, and the overhead is their ratio.
    assert set(spec.cost.plain) == set(spec.cost.verify) == {1}
    assert spec.cost.overhead(1) == pytest.approx(max(0.0, spec.cost.verify[1] / spec.cost.plain[1] - 1))
