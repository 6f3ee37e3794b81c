"""Scheduler options beside the budget: full-prompt reservation, a smaller per-step token budget,
and the V0 partial-prefill knobs (rejected)."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, make_request, make_scheduler, next_token, run_until_done, step

from pagedllm.engine.protocol import FinishReason


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


@pytest.mark.parametrize("reserve", [False, True])
def test_reserve_full_prompt_blocks_before_admission(reserve: bool) -> None:
    s = make_scheduler(
        num_blocks=8,
        block_size=4,
        max_model_len=32,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
        scheduler_reserve_full_isl=reserve,
    )
    runner = FakeRunner(s.block_size)
    a, b = list(range(20)), list(range(100, 116))
    s.add_request(make_request(s, "a", a, max_tokens=2))
    s.add_request(make_request(s, "b", b, max_tokens=2))
    assert step(s, runner)[0].num_scheduled_tokens == {"a": 8}
    assert step(s, runner)[0].num_scheduled_tokens == {"a": 8}
    so, _ = step(s, runner)
    # "a" holds 5 of the 8 blocks: "b" (4 blocks for its prompt) may start only without reservation.
    assert so.num_scheduled_tokens == ({"a": 4} if reserve else {"a": 4, "b": 4})
    res = run_until_done(s, runner)
    assert res.tokens == {"a": expected_tokens(a, 2), "b": expected_tokens(b, 2)}
    assert res.finish == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_max_num_scheduled_tokens_caps_the_step() -> None:
    s = make_scheduler(max_num_batched_tokens=32, max_num_scheduled_tokens=5)
    runner = FakeRunner(s.block_size)
    prompts = {"a": list(range(9)), "b": list(range(50, 53))}
    for r, p in prompts.items():
        s.add_request(make_request(s, r, p, max_tokens=3))
    assert step(s, runner)[0].num_scheduled_tokens == {"a": 5}
    assert step(s, runner)[0].num_scheduled_tokens == {"a": 4, "b": 1}
    res = run_until_done(s, runner)
    assert all(so.total_num_scheduled_tokens <= 5 for so in runner.steps)
    assert res.tokens == {r: expected_tokens(p, 3) for r, p in prompts.items()}


@pytest.mark.parametrize(("scheduled", "budget"), [(None, 32), (5, 5), (32, 32), (40, 32)])
def test_the_step_budget_is_the_configs_one_formula(scheduled: int | None, budget: int) -> None:
    s = make_scheduler(max_num_batched_tokens=32, max_num_scheduled_tokens=scheduled)
    assert s.max_num_scheduled_tokens == budget


@pytest.mark.parametrize("field", ["max_num_partial_prefills", "max_long_partial_prefills"])
def test_partial_prefill_limits_are_rejected(field: str) -> None:
    extra = {"max_num_partial_prefills": 2} if field == "max_long_partial_prefills" else {}
    with pytest.raises(ValueError, match=f"{field}=2.*not supported"):
        make_scheduler(**{field: 2, **extra})


def test_long_prefill_threshold_does_not_chunk_without_chunked_prefill() -> None:
    s = make_scheduler(
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=4,
    )
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(30)), max_tokens=2))
    assert step(s, runner)[0].num_scheduled_tokens == {"a": 30}
    assert run_until_done(s, runner).tokens["a"] == expected_tokens(list(range(30)), 2)
