"""The scheduler driven by a fake runner (no model): budgets, chunking, preemption, policies, stops."""

from __future__ import annotations

import random

import pytest
from fake_runner import (
    FakeRunner,
    assert_all_blocks_free,
    make_request,
    make_scheduler,
    next_token,
    run_until_done,
    step,
)

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import FinishReason

VOCAB_SMALL = 50


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """What the fake model generates for a prompt run alone, without any scheduling."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


# ------------------------------------------------------------------------------------- chunking
def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=128, num_blocks=64)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "short", [1, 2, 3], max_tokens=20))
    step(s, runner)  # prefill of "short"
    s.add_request(make_request(s, "long", list(range(100, 150)), max_tokens=2))
    chunks = []
    while "long" not in runner.reqs or runner.reqs["long"].num_computed < 50:
        so, _ = step(s, runner)
        # The decode is never starved by the long prompt, which gets the rest of the budget.
        assert so.num_scheduled_tokens["short"] == 1
        chunks.append(so.num_scheduled_tokens["long"])
    assert chunks == [15, 15, 15, 5]
    # The last chunk sampled: one output token for "long".
    assert s.requests["long"].output_token_ids == expected_tokens(list(range(100, 150)), 1)
    res = run_until_done(s, runner)
    assert res.finish == {"short": FinishReason.LENGTH, "long": FinishReason.LENGTH}


def test_mid_prefill_chunk_reports_nothing_and_num_computed_catches_up() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(s.block_size)
    req = make_request(s, "a", list(range(20)), max_tokens=1)
    s.add_request(req)
    so, outs = step(s, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens == {"a": 8}
    assert outs.outputs == [] and req.num_computed_tokens == 8
    so, outs = step(s, runner)
    assert so.scheduled_cached_reqs.num_computed_tokens == [8] and outs.outputs == []
    so, outs = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 4}
    assert outs.outputs[0].new_token_ids == expected_tokens(list(range(20)), 1)
    assert outs.outputs[0].finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(s)


def test_long_prefill_token_threshold_caps_chunks() -> None:
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(20)), max_tokens=1))
    s.add_request(make_request(s, "b", list(range(50, 53)), max_tokens=1))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 6, "b": 3}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 6}
    run_until_done(s, runner)


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(40)), max_tokens=4))
    s.add_request(make_request(s, "b", list(range(100, 130)), max_tokens=4))
    s.add_request(make_request(s, "c", [7], max_tokens=4))
    so, _ = step(s, runner)
    # "b" does not fit the 24 tokens left, and "c" may not overtake it.
    assert so.num_scheduled_tokens == {"a": 40}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30, "c": 1}
    res = run_until_done(s, runner)
    assert res.tokens["b"] == expected_tokens(list(range(100, 130)), 4)


# --------------------------------------------------------------------------------------- limits
def test_max_num_seqs_limits_running_requests() -> None:
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    runner = FakeRunner(s.block_size)
    for i in range(5):
        s.add_request(make_request(s, str(i), [i + 1, 2, 3], max_tokens=3))
    so, _ = step(s, runner)
    assert sorted(so.num_scheduled_tokens) == ["0", "1", "2"]
    assert len(s.waiting) == 2
    res = run_until_done(s, runner)
    assert res.tokens == {str(i): expected_tokens([i + 1, 2, 3], 3) for i in range(5)}


def test_token_budget_is_shared_in_order() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(7)), max_tokens=2))
    s.add_request(make_request(s, "b", list(range(20, 27)), max_tokens=2))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 7, "b": 3}
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    run_until_done(s, runner)


# ---------------------------------------------------------------------------------- preemption
def test_preemption_frees_requeues_and_resumes_with_all_tokens() -> None:
    # 6 blocks of 4 tokens; each request needs up to 3 blocks (8-token prompt + 4 outputs).
    s = make_scheduler(num_blocks=6, max_model_len=24, max_num_batched_tokens=32, enable_prefix_caching=False)
    runner = FakeRunner(s.block_size)
    prompts = {r: [10 * i + j for j in range(8)] for i, r in enumerate("abc")}
    for r, p in prompts.items():
        s.add_request(make_request(s, r, p, max_tokens=8))
    so, _ = step(s, runner)
    assert sorted(so.num_scheduled_tokens) == ["a", "b", "c"]  # 2 blocks each: the cache is full
    so, _ = step(s, runner)
    # "a" needs a third block at token 9: the latest arrival ("c") is preempted to make room.
    assert so.preempted_req_ids == {"c"}
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.waiting.peek() is c and c not in s.running
    assert s.kv_cache_manager.get_block_ids("c") == []
    assert c.num_output_tokens == 1  # its first token survives the preemption
    # Resumed later as a new request carrying its prompt and its output so far.
    resumed = None
    for _ in range(50):
        so, _ = step(s, runner)
        new = [r for r in so.scheduled_new_reqs if r.req_id == "c"]
        if new:
            resumed = new[0]
            break
    assert resumed is not None
    assert resumed.num_prompt_tokens == 8
    assert resumed.token_ids[:8] == prompts["c"] and len(resumed.token_ids) >= 9
    # The resumed step sampled one more token after those it was sent with.
    assert resumed.token_ids[8:] == c.output_token_ids[:-1]
    res = run_until_done(s, runner)
    assert res.tokens == {r: expected_tokens(p, 8) for r, p in prompts.items()}


def test_preempted_request_is_resumed_before_new_arrivals() -> None:
    s = make_scheduler(num_blocks=4, max_model_len=16, max_num_batched_tokens=32, enable_prefix_caching=False)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(8)), max_tokens=8))
    s.add_request(make_request(s, "b", list(range(20, 28)), max_tokens=8))
    step(s, runner)
    # "late" arrives before "b" is preempted, yet "b" goes back to the front of the line.
    s.add_request(make_request(s, "late", [5, 6], max_tokens=2))
    so, _ = step(s, runner)
    assert so.preempted_req_ids == {"b"}
    assert [r.request_id for r in s.waiting] == ["b", "late"]
    res = run_until_done(s, runner)
    assert res.tokens["b"] == expected_tokens(list(range(20, 28)), 8)
    assert res.num_preemptions >= 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("budget", [5, 16, 64])
@pytest.mark.parametrize("num_blocks,caching", [(200, True), (200, False), (16, True), (16, False)])
def test_outputs_independent_of_scheduling(policy: str, budget: int, num_blocks: int, caching: bool) -> None:
    """Random prompts with shared prefixes: every request's output equals the unscheduled reference,
    whatever the budget, cache size (16 blocks forces preemption) and prefix caching."""
    rng = random.Random(1234)
    system = [rng.randrange(VOCAB_SMALL) for _ in range(13)]
    s = make_scheduler(
        num_blocks=num_blocks,
        max_model_len=64,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        policy=policy,
    )
    runner = FakeRunner(s.block_size)
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    pending = []
    for i in range(20):
        tail = [rng.randrange(VOCAB_SMALL) for _ in range(rng.randrange(1, 20))]
        prompts[str(i)] = (system if i % 2 else []) + tail
        max_tokens[str(i)] = rng.randrange(1, 16)
        pending.append(str(i))
    # Requests arrive over time, a few per step.
    res_tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    preemptions = 0
    t = 0
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                r = pending.pop(0)
                req = make_request(
                    s, r, prompts[r], max_tokens=max_tokens[r], arrival_time=t, priority=int(r) % 3
                )
                s.add_request(req)
        t += 1
        if not s.has_unfinished_requests():
            continue
        _, outs = step(s, runner)
        assert outs.scheduler_stats is not None
        preemptions += outs.scheduler_stats.num_preemptions
        for o in outs.outputs:
            res_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason
        assert t < 3000
    assert_all_blocks_free(s)
    assert res_tokens == {r: expected_tokens(p, max_tokens[r]) for r, p in prompts.items()}
    assert finish == {r: FinishReason.LENGTH for r in prompts}
    if num_blocks == 16 and budget == 64:
        assert preemptions > 0


def test_a_step_that_preempts_admits_nobody() -> None:
    s = make_scheduler(
        num_blocks=4,
        max_model_len=16,
        policy="priority",
        enable_prefix_caching=False,
        max_num_batched_tokens=32,
    )
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(8)), max_tokens=8, priority=0))
    s.add_request(make_request(s, "b", list(range(20, 28)), max_tokens=8, priority=5))
    step(s, runner)  # both prompts fill the 4 blocks
    # "c" outranks "b" and would fit in the block left over after "b" is preempted, but a step that had
    # to preempt admits nobody (the cache is full: admitting would only preempt again).
    s.add_request(make_request(s, "c", [5], max_tokens=2, priority=1, arrival_time=1))
    so, _ = step(s, runner)
    assert so.preempted_req_ids == {"b"} and so.scheduled_new_reqs == []
    so, _ = step(s, runner)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["c"]
    run_until_done(s, runner)


# ------------------------------------------------------------------------------------ priority
def test_priority_admission_order() -> None:
    s = make_scheduler(max_num_seqs=1, policy="priority")
    runner = FakeRunner(s.block_size)
    for r, prio, t in [("low", 5, 0.0), ("high", 0, 2.0), ("mid", 1, 1.0), ("high_early", 0, 1.5)]:
        s.add_request(make_request(s, r, [1, 2, 3], max_tokens=1, arrival_time=t, priority=prio))
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        order.extend(r.req_id for r in so.scheduled_new_reqs)
    assert order == ["high_early", "high", "mid", "low"]


def test_fcfs_admission_order_ignores_priority() -> None:
    s = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(s.block_size)
    for r, prio in [("a", 5), ("b", 0), ("c", 1)]:
        s.add_request(make_request(s, r, [1, 2, 3], max_tokens=1, priority=prio))
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        order.extend(r.req_id for r in so.scheduled_new_reqs)
    assert order == ["a", "b", "c"]


def test_priority_preempts_the_worst_priority_even_if_scheduled_earlier() -> None:
    s = make_scheduler(
        num_blocks=6,
        max_model_len=24,
        policy="priority",
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
    )
    runner = FakeRunner(s.block_size)
    # Admitted in priority order: "p0" (0), "p1" (1), "p9" (9). Each fills 2 of the 6 blocks.
    s.add_request(make_request(s, "p9", list(range(8)), max_tokens=8, priority=9, arrival_time=0))
    s.add_request(make_request(s, "p1", list(range(20, 28)), max_tokens=8, priority=1, arrival_time=1))
    s.add_request(make_request(s, "p0", list(range(40, 48)), max_tokens=8, priority=0, arrival_time=2))
    step(s, runner)
    assert [r.request_id for r in s.running] == ["p0", "p1", "p9"]
    so, _ = step(s, runner)
    # "p0" needs a block first; the victim is "p9" (worst priority), not the current request.
    assert so.preempted_req_ids == {"p9"}
    assert set(so.num_scheduled_tokens) == {"p0", "p1"}
    res = run_until_done(s, runner)
    assert res.tokens["p0"] == expected_tokens(list(range(40, 48)), 8)


def test_priority_undoes_a_victim_scheduled_in_the_same_step() -> None:
    s = make_scheduler(
        num_blocks=5,
        max_model_len=20,
        policy="priority",
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
    )
    runner = FakeRunner(s.block_size)
    # "bad" (priority 9) is admitted first (alone), then "good" (priority 0) while "bad" runs.
    s.add_request(make_request(s, "bad", list(range(7)), max_tokens=10, priority=9))
    step(s, runner)
    s.add_request(make_request(s, "good", list(range(20, 27)), max_tokens=10, priority=0, arrival_time=1))
    step(s, runner)
    assert [r.request_id for r in s.running] == ["bad", "good"]
    # Run until "good" cannot grow: "bad" (scheduled earlier in that step) must be undone and preempted.
    for _ in range(30):
        so, _ = step(s, runner)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"bad"}
            assert "bad" not in so.num_scheduled_tokens and "good" in so.num_scheduled_tokens
            assert so.total_num_scheduled_tokens == so.num_scheduled_tokens["good"]
            break
    else:
        pytest.fail("no preemption happened")
    res = run_until_done(s, runner)
    assert s.requests == {} and res.finish["bad"] == FinishReason.LENGTH


# ---------------------------------------------------------------------------------------- stops
def finish_of(scheduler: Scheduler, runner: FakeRunner) -> tuple[list[int], FinishReason, int | str | None]:
    res = run_until_done(scheduler, runner)
    (req_id,) = res.tokens
    return res.tokens[req_id], res.finish[req_id], res.stop_reason[req_id]


def test_eos_stops_unless_ignore_eos() -> None:
    s = make_scheduler()
    runner = FakeRunner(s.block_size, scripts={"a": [5, 6, 2, 7, 8]})
    s.add_request(make_request(s, "a", [1, 2, 3], max_tokens=10, eos_token_id=2))
    assert finish_of(s, runner) == ([5, 6, 2], FinishReason.STOP, None)

    runner = FakeRunner(s.block_size, scripts={"a": [5, 6, 2, 7, 8]})
    s.add_request(make_request(s, "a", [1, 2, 3], max_tokens=5, eos_token_id=2, ignore_eos=True))
    assert finish_of(s, runner) == ([5, 6, 2, 7, 8], FinishReason.LENGTH, None)


def test_stop_token_ids_set_stop_reason_even_with_ignore_eos() -> None:
    s = make_scheduler()
    runner = FakeRunner(s.block_size, scripts={"a": [5, 9, 6]})
    s.add_request(make_request(s, "a", [1, 2, 3], eos_token_id=2, stop_token_ids=[9], ignore_eos=True))
    assert finish_of(s, runner) == ([5, 9], FinishReason.STOP, 9)


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    s = make_scheduler()
    runner = FakeRunner(s.block_size, scripts={"a": [2, 9, 4, 9, 2]})
    s.add_request(make_request(s, "a", [1, 2, 3], eos_token_id=2, stop_token_ids=[9], min_tokens=3))
    assert finish_of(s, runner) == ([2, 9, 4, 9], FinishReason.STOP, 9)


def test_max_tokens_is_length() -> None:
    s = make_scheduler()
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", [1, 2, 3], max_tokens=4))
    assert finish_of(s, runner) == (expected_tokens([1, 2, 3], 4), FinishReason.LENGTH, None)


def test_max_model_len_is_length_even_below_min_tokens() -> None:
    s = make_scheduler(max_model_len=12)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(9)), max_tokens=None, min_tokens=5))
    tokens, reason, _ = finish_of(s, runner)
    assert tokens == expected_tokens(list(range(9)), 3) and reason == FinishReason.LENGTH


def test_prompt_too_long_is_rejected_with_numbers() -> None:
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match=r"16 tokens.*max_model_len=16.*at most 15"):
        s.add_request(make_request(s, "a", list(range(16))))
    assert not s.has_unfinished_requests()
    # The longest allowed prompt runs and generates exactly one token.
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "b", list(range(15)), max_tokens=None))
    assert finish_of(s, runner) == (expected_tokens(list(range(15)), 1), FinishReason.LENGTH, None)


def test_duplicate_request_id_is_rejected() -> None:
    s = make_scheduler()
    s.add_request(make_request(s, "a", [1, 2]))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request(s, "a", [1, 2]))
    assert s.get_num_unfinished_requests() == 1


def test_cache_smaller_than_one_sequence_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"3 blocks of 4 tokens.*max_model_len=16"):
        make_scheduler(num_blocks=3, max_model_len=16)


# ---------------------------------------------------------------------------------------- aborts
def test_abort_running_waiting_and_preempted_requests() -> None:
    s = make_scheduler(num_blocks=4, max_model_len=16, max_num_seqs=2, enable_prefix_caching=False)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "run", list(range(8)), max_tokens=8))
    s.add_request(make_request(s, "pre", list(range(20, 28)), max_tokens=8))
    s.add_request(make_request(s, "wait", [1, 2], max_tokens=8))
    step(s, runner)
    so, _ = step(s, runner)
    assert so.preempted_req_ids == {"pre"}
    assert s.requests["pre"].status == RequestStatus.PREEMPTED
    s.finish_requests(["pre", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sorted(s.requests) == ["run"] and len(s.waiting) == 0
    so, outs = step(s, runner)
    assert so.finished_req_ids == {"pre", "wait"}
    assert {o.request_id for o in outs.outputs} == {"run"}
    s.finish_requests("run", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    so = s.schedule()
    assert so.finished_req_ids == {"run"} and so.is_empty
    assert_all_blocks_free(s)
    assert s.reset_prefix_cache()


def test_abort_between_schedule_and_update() -> None:
    s = make_scheduler()
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", [1, 2, 3]))
    s.add_request(make_request(s, "b", [4, 5, 6]))
    so = s.schedule()
    ro = runner.execute_model(so)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(so, ro)
    assert [o.request_id for o in outs.outputs] == ["b"]
    run_until_done(s, runner)


def test_finish_requests_needs_a_finished_status() -> None:
    s = make_scheduler()
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_requests(["a"], RequestStatus.RUNNING)


# ---------------------------------------------------------------------------------------- stats
def test_stats_and_prefix_hits_between_requests() -> None:
    s = make_scheduler(block_size=4)
    runner = FakeRunner(s.block_size)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    s.add_request(make_request(s, "a", shared + [1, 2], max_tokens=10))
    _, outs = step(s, runner)
    stats = outs.scheduler_stats
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12, 0)
    assert stats.kv_cache_usage == 3 / 64
    s.add_request(make_request(s, "b", shared + [3], max_tokens=2))
    so, outs = step(s, runner)
    (new,) = so.scheduled_new_reqs
    # The 2 full blocks of the shared prefix are hits; the partial third block is not.
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens["b"] == 3
    assert new.block_ids[:2] == s.kv_cache_manager.get_block_ids("a")[:2]
    assert outs.scheduler_stats is not None
    assert (outs.scheduler_stats.prefix_cache_queries, outs.scheduler_stats.prefix_cache_hits) == (11, 8)
    res = run_until_done(s, runner)
    assert res.tokens["b"] == expected_tokens(shared + [3], 2)
    assert [o.num_cached_tokens for o in outs.outputs if o.request_id == "b"] == [8]


def test_no_stats_without_log_stats() -> None:
    s = make_scheduler(log_stats=False)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", [1, 2, 3]))
    so = s.schedule()
    assert s.update_from_output(so, runner.execute_model(so)).scheduler_stats is None
    assert s.make_stats() is None


def test_budget_of_an_undone_victim_is_reused_in_the_same_step() -> None:
    s = make_scheduler(
        num_blocks=10,
        max_model_len=40,
        policy="priority",
        enable_prefix_caching=False,
        max_num_batched_tokens=8,
    )
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "bad", [1, 2, 3], max_tokens=30, priority=9))
    step(s, runner)
    s.add_request(make_request(s, "good", [4, 5, 6], max_tokens=30, priority=0, arrival_time=1))
    s.add_request(make_request(s, "long", list(range(100, 136)), max_tokens=3, priority=5, arrival_time=2))
    for _ in range(10):
        so, _ = step(s, runner)
        if so.preempted_req_ids:
            # "long" ran out of blocks after "bad" was scheduled; "bad" is undone and its token of
            # budget goes to the chunk of "long".
            assert so.preempted_req_ids == {"bad"}
            assert so.num_scheduled_tokens == {"good": 1, "long": 7}
            break
    else:
        pytest.fail("no preemption happened")
    res = run_until_done(s, runner)
    assert res.tokens == {
        "bad": expected_tokens([1, 2, 3], 30),
        "good": expected_tokens([4, 5, 6], 30),
        "long": expected_tokens(list(range(100, 136)), 3),
    }


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make_scheduler(
        num_blocks=6,
        max_model_len=24,
        policy="priority",
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
    )
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "p9", list(range(11)), max_tokens=10, priority=9))
    s.add_request(make_request(s, "p0", list(range(20, 27)), max_tokens=10, priority=0, arrival_time=1))
    step(s, runner)
    s.add_request(make_request(s, "p1", [1, 2, 3, 4, 5], max_tokens=2, priority=1, arrival_time=2))
    so, _ = step(s, runner)
    assert so.scheduled_new_reqs == []  # p1 needs 2 blocks, 1 is free
    so, _ = step(s, runner)
    assert so.preempted_req_ids == {"p9"}
    # p9's blocks would now fit p1, but a step that had to preempt admits nothing.
    assert so.scheduled_new_reqs == []
    so, _ = step(s, runner)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["p1"]
    run_until_done(s, runner)


def test_undone_victim_leaves_no_unwritten_block_in_the_prefix_cache() -> None:
    # "bad" (priority 9) is prefilled 3 tokens a step. In the step where it would complete its 8th
    # block, "good" runs out of blocks after "bad" was scheduled, and "bad" is undone: the 8th block,
    # registered by that step's allocation, never gets its KV and must not stay in the prefix cache.
    s = make_scheduler(
        num_blocks=12,
        max_model_len=48,
        policy="priority",
        max_num_batched_tokens=9,
        long_prefill_token_threshold=3,
    )
    runner = FakeRunner(s.block_size)
    bad_prompt = list(range(100, 143))
    bad = make_request(s, "bad", bad_prompt, max_tokens=3, priority=9)
    s.add_request(bad)
    step(s, runner)
    s.add_request(make_request(s, "good", [1, 2, 3, 4, 5], max_tokens=40, priority=0, arrival_time=1))
    for _ in range(20):
        before = bad.num_computed_tokens
        so, _ = step(s, runner)
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == {"bad"} and before == 30
    table = s.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert bad.block_hashes[6] in table and bad.block_hashes[7] not in table
    s.add_request(make_request(s, "copy", bad_prompt, max_tokens=3, priority=0, arrival_time=2))
    res = run_until_done(s, runner)
    assert res.tokens["copy"] == res.tokens["bad"] == expected_tokens(bad_prompt, 3)


# ------------------------------------------------------------------------------ speculative drafts
def _decoding_request(s: Scheduler, runner: FakeRunner, prompt_len: int = 9) -> tuple[Request, int]:
    req = make_request(s, "a", list(range(1, prompt_len + 1)), max_tokens=20)
    s.add_request(req)
    step(s, runner)  # the prompt, and the first output token
    assert req.num_computed_tokens == req.num_tokens - 1
    return req, req.num_tokens


def _runner_output(req_id: str, tokens: list[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[req_id], req_id_to_index={req_id: 0}, sampled_token_ids=[tokens])


@pytest.mark.parametrize("num_accepted", [0, 2, 3])
def test_drafts_are_scheduled_after_the_last_token_and_rejects_roll_back(num_accepted: int) -> None:
    s = make_scheduler()
    req, num_tokens = _decoding_request(s, FakeRunner(s.block_size))
    s.update_draft_token_ids({"a": [11, 12, 13], "unknown": [1]})
    assert req.num_tokens_with_spec == num_tokens + 3
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.total_num_scheduled_tokens == 4
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    # The drafts are consumed by the step; the KV of all four tokens is in flight.
    assert req.spec_token_ids == [] and req.num_computed_tokens == num_tokens + 3
    assert len(s.kv_cache_manager.get_block_ids("a")) * s.block_size >= num_tokens + 3
    # The runner returns the accepted drafts plus one token of its own.
    sampled = [11, 12, 13][:num_accepted] + [40]
    out = s.update_from_output(so, _runner_output("a", sampled))
    assert out.outputs[0].new_token_ids == sampled
    assert req.num_tokens == num_tokens + len(sampled)
    # Everything but the newest token is computed: rejected drafts' slots get recomputed.
    assert req.num_computed_tokens == req.num_tokens - 1
    assert s.schedule().num_scheduled_tokens == {"a": 1}


def test_drafts_are_cut_to_the_budget_and_max_model_len_and_dropped_at_preemption() -> None:
    s = make_scheduler(max_num_batched_tokens=3)
    req, num_tokens = _decoding_request(s, FakeRunner(s.block_size), prompt_len=2)
    s.update_draft_token_ids({"a": [11, 12, 13, 14]})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [11, 12]}
    s.update_from_output(so, _runner_output("a", [40]))

    s = make_scheduler(max_model_len=12)
    req, num_tokens = _decoding_request(s, FakeRunner(s.block_size))
    s.update_draft_token_ids({"a": [11, 12, 13, 14]})
    so = s.schedule()
    assert num_tokens + len(so.scheduled_spec_decode_tokens["a"]) == 12

    s = make_scheduler()
    req, _ = _decoding_request(s, FakeRunner(s.block_size))
    s.update_draft_token_ids({"a": [11, 12]})
    s._preempt(s.running.pop())
    assert req.spec_token_ids == [] and req.num_tokens_with_spec == req.num_tokens


def test_grammar_bitmask_stage_has_nothing_to_constrain_yet() -> None:
    s = make_scheduler()
    _decoding_request(s, FakeRunner(s.block_size))
    assert s.get_grammar_bitmask(s.schedule()) is None
