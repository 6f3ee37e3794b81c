"""The scheduler's side of structured outputs, with fake grammars (no grammar engine, no model): a
request waits for its grammar without holding up others, the bitmask covers exactly the constrained
requests that sample this step, the grammar follows every accepted token (also across preemption) and
ends the request when it terminates, and a grammar that failed to compile fails its request alone."""

from __future__ import annotations

from typing import Any

from fake_runner import FakeRunner, make_request, make_scheduler, run_until_done, step

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import FinishReason
from pagedllm.errors import ErrorReport


class FakeGrammar:
    """Ready when told; terminates after `length` accepted tokens; records what it accepted."""

    def __init__(self, ready: bool = True, length: int = 1000, error: str | None = None) -> None:
        self.ready = ready
        self.length = length
        self.error = error
        self.accepted: list[int] = []
        self.matcher_built = False

    def is_ready(self) -> bool:
        return self.ready

    def init_matcher(self) -> None:
        if self.error is not None:
            raise ValueError(self.error)
        self.matcher_built = True

    def accept_token(self, token_id: int) -> bool:
        assert self.matcher_built
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


class FakeManager:
    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def grammar_bitmask(self, grammars: list[Any]) -> list[Any]:
        self.calls.append(list(grammars))
        return [("mask", id(g)) for g in grammars]


def so_scheduler(manager: FakeManager | None = None, **kw: Any) -> Scheduler:
    s = make_scheduler(**kw)
    s.structured_output_manager = manager or FakeManager()
    return s


def constrained(
    scheduler: Scheduler, req_id: str, prompt: list[int], grammar: FakeGrammar, **kw: Any
) -> Request:
    request = make_request(scheduler, req_id, prompt, **kw)
    request.structured_output_request = grammar
    return request


def test_no_constrained_request_means_no_bitmask_and_no_manager_call() -> None:
    manager = FakeManager()
    s = so_scheduler(manager)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", [1, 2, 3], max_tokens=3))
    so, _ = step(s, runner)
    assert s.get_grammar_bitmask(so) is None and manager.calls == []


def test_waiting_grammar_does_not_hold_up_others_and_joins_when_ready() -> None:
    manager = FakeManager()
    s = so_scheduler(manager)
    runner = FakeRunner(s.block_size)
    grammar = FakeGrammar(ready=False)
    s.add_request(constrained(s, "slow", [1, 2, 3], grammar, max_tokens=2))
    s.add_request(make_request(s, "free", [4, 5, 6], max_tokens=2))
    assert s.requests["slow"].status == RequestStatus.WAITING_FOR_FSM
    so, _ = step(s, runner)
    assert set(so.num_scheduled_tokens) == {"free"}
    grammar.ready = True
    so, _ = step(s, runner)
    assert "slow" in so.num_scheduled_tokens and grammar.matcher_built
    res = run_until_done(s, runner)
    assert grammar.accepted == res.tokens["slow"]


def test_bitmask_only_for_constrained_requests_that_sample() -> None:
    manager = FakeManager()
    s = so_scheduler(manager, max_num_batched_tokens=8)
    runner = FakeRunner(s.block_size)
    g_long, g_short = FakeGrammar(), FakeGrammar()
    s.add_request(constrained(s, "short", [1, 2, 3], g_short, max_tokens=4))
    s.add_request(constrained(s, "long", list(range(10, 22)), g_long, max_tokens=4))
    s.add_request(make_request(s, "plain", [7, 8], max_tokens=4))
    so = s.schedule()
    # "long" is mid-prefill (5 of 12 tokens this step): it samples nothing, so it gets no row.
    assert so.num_scheduled_tokens == {"short": 3, "long": 5}
    out = s.get_grammar_bitmask(so)
    assert out is not None and out.structured_output_request_ids == ["short"]
    assert out.grammar_bitmask == [("mask", id(g_short))]
    outs = s.update_from_output(so, runner.execute_model(so))
    first = {o.request_id: o.new_token_ids for o in outs.outputs}
    res = run_until_done(s, runner)
    assert g_short.accepted == first["short"] + res.tokens["short"] and g_long.accepted == res.tokens["long"]


def test_grammar_termination_finishes_the_request_with_stop() -> None:
    s = so_scheduler()
    runner = FakeRunner(s.block_size)
    grammar = FakeGrammar(length=3)
    s.add_request(constrained(s, "a", [1, 2, 3], grammar, max_tokens=10))
    res = run_until_done(s, runner)
    assert len(res.tokens["a"]) == 3 and res.finish["a"] == FinishReason.STOP
    assert s.constrained_req_ids == set()


def test_grammar_follows_the_tokens_across_preemption() -> None:
    s = so_scheduler(num_blocks=16, max_model_len=64)
    runner = FakeRunner(s.block_size)
    grammars = {f"r{i}": FakeGrammar() for i in range(4)}
    for i, (req_id, grammar) in enumerate(grammars.items()):
        s.add_request(constrained(s, req_id, list(range(i * 10, i * 10 + 8)), grammar, max_tokens=20))
    res = run_until_done(s, runner)
    assert res.num_preemptions > 0
    for req_id, grammar in grammars.items():
        # Preemption keeps the output tokens, so each token is accepted exactly once, in order.
        assert grammar.accepted == res.tokens[req_id]


def test_failed_grammar_fails_its_request_alone() -> None:
    s = so_scheduler()
    runner = FakeRunner(s.block_size)
    s.add_request(constrained(s, "bad", [1, 2], FakeGrammar(ready=False, error="bad schema")))
    s.add_request(constrained(s, "bad-now", [1, 2], FakeGrammar(error="bad regex")))
    s.add_request(make_request(s, "good", [3, 4], max_tokens=2))
    # A grammar that does not compile is the constraint's fault: its report names the field.
    assert s.grammar_errors == {"bad-now": ErrorReport("ValueError: bad regex", "structured_outputs")}
    s.grammar_errors = {}
    s.requests["bad"].structured_output_request.ready = True  # type: ignore[union-attr]
    res = run_until_done(s, runner)
    assert s.grammar_errors == {"bad": ErrorReport("ValueError: bad schema", "structured_outputs")}
    assert set(res.tokens) == {"good"} and not s.has_unfinished_requests()


def test_abort_while_waiting_for_the_grammar() -> None:
    s = so_scheduler()
    s.add_request(constrained(s, "a", [1, 2], FakeGrammar(ready=False)))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.waiting_for_fsm == [] and not s.has_unfinished_requests() and s.constrained_req_ids == set()


def test_requests_waiting_for_their_grammar_count_as_waiting() -> None:
    s = so_scheduler()
    runner = FakeRunner(s.block_size)
    grammars = [FakeGrammar(ready=False), FakeGrammar(ready=False)]
    for i, grammar in enumerate(grammars):
        s.add_request(constrained(s, f"g{i}", [1, 2, 3], grammar, max_tokens=2))
    # Nothing to schedule until a grammar compiles: the engine sleeps instead of stepping.
    assert s.waiting_only_for_grammars()
    stats = s.make_stats()
    assert stats is not None and (stats.num_waiting_reqs, stats.num_running_reqs) == (2, 0)
    s.add_request(make_request(s, "free", [4, 5], max_tokens=2))
    assert not s.waiting_only_for_grammars()
    step(s, runner)
    stats = s.make_stats()
    assert stats is not None and (stats.num_waiting_reqs, stats.num_running_reqs) == (2, 1)
    while "free" in s.requests:
        step(s, runner)
    # A compiled grammar waits to be admitted by the next schedule(): a step must run.
    assert s.waiting_only_for_grammars()
    grammars[0].ready = True
    assert not s.waiting_only_for_grammars()
    so, _ = step(s, runner)
    assert "g0" in so.num_scheduled_tokens
