"""The engine core's operations as the offline API reaches them: utility and worker-method names are
checked, sleep mode must be enabled, weight updates need an idle engine with awake weights and reset
the prefix cache (a cached prompt then runs on the new weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_llm import hf_greedy

from pagedllm import LLM, SamplingParams

# Three full blocks of 16 tokens: cached by the prefix cache after the first run.
PROMPT = [(11 * i) % 300 + 3 for i in range(50)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(two_tiny_llms: tuple[Path, Path]) -> LLM:
    return LLM(
        model=str(two_tiny_llms[0]),
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        enable_sleep_mode=True,
    )


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_names_are_checked(llm: LLM) -> None:
    with pytest.raises(ValueError, match="unknown engine utility 'shutdown'"):
        llm.llm_engine.call_utility("shutdown")
    for method in ("_require_profiler", "load_model()", ""):
        with pytest.raises(ValueError, match="public worker method"):
            llm.collective_rpc(method)
    assert llm.collective_rpc(lambda worker, x: (worker.rank, x), args=(7,)) == [(0, 7)]


def test_update_resets_the_prefix_cache(llm: LLM, two_tiny_llms: tuple[Path, Path]) -> None:
    first, second = two_tiny_llms
    assert _greedy(llm) == hf_greedy(first, [PROMPT], MAX_TOKENS)[0]
    llm.update_weights_from_disk(str(second))
    assert _greedy(llm) == hf_greedy(second, [PROMPT], MAX_TOKENS)[0]
    llm.update_weights_from_disk(str(first))
    assert _greedy(llm) == hf_greedy(first, [PROMPT], MAX_TOKENS)[0]


def test_update_needs_idle_engine_and_awake_weights(llm: LLM, two_tiny_llms: tuple[Path, Path]) -> None:
    llm.llm_engine.add_request("busy", "Hello", SamplingParams(max_tokens=2))
    try:
        with pytest.raises(ValueError, match="a weight update needs an idle engine"):
            llm.update_weights_from_disk(str(two_tiny_llms[1]))
    finally:
        llm.llm_engine.abort_request("busy")
    llm.sleep(level=2)
    try:
        with pytest.raises(ValueError, match="wake_up\\(tags=\\['weights'\\]\\)"):
            llm.update_weights_from_disk(str(two_tiny_llms[1]))
        # With the weights awake (reloaded from the checkpoint), an update replaces them.
        llm.wake_up(tags=["weights"])
        llm.update_weights_from_disk(str(two_tiny_llms[1]))
    finally:
        llm.wake_up()
    assert _greedy(llm) == hf_greedy(two_tiny_llms[1], [PROMPT], MAX_TOKENS)[0]


def test_deferred_update_holds_waiting_requests_until_running_ones_finish(
    llm: LLM, two_tiny_llms: tuple[Path, Path]
) -> None:
    """What the engine core process does with a weight update on a busy engine: the running request
    finishes on the old weights, a request arriving meanwhile is held and runs on the new ones."""
    first, second = two_tiny_llms
    engine, core = llm.llm_engine, llm.llm_engine.engine_core.core  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    llm.update_weights_from_disk(str(first))  # whatever the tests before left
    assert not core.defers("update_weights_from_disk")  # idle: runs at once
    engine.add_request("running", {"prompt_token_ids": PROMPT}, params)
    tokens: dict[str, list[int]] = {}
    engine.step()
    assert not core.defers("sleep") and core.defers("update_weights_from_disk")
    engine.add_request("held", {"prompt_token_ids": PROMPT}, params)
    try:
        while core.scheduler.running:
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        assert "held" not in tokens and core.scheduler.get_num_unfinished_requests() == 1
        core.call_utility("update_weights_from_disk", (str(second),))
    finally:
        core.release_held_requests()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert tokens["running"] == hf_greedy(first, [PROMPT], MAX_TOKENS)[0]
    assert tokens["held"] == hf_greedy(second, [PROMPT], MAX_TOKENS)[0]


def test_sleep_mode_must_be_enabled(two_tiny_llms: tuple[Path, Path]) -> None:
    llm = LLM(model=str(two_tiny_llms[0]), dtype="float32", max_model_len=128, enforce_eager=True)
    with pytest.raises(ValueError, match="sleep mode is not enabled"):
        llm.sleep()
    assert not llm.is_sleeping()
