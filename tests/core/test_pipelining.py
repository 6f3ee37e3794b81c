"""The scheduler with several batches in flight (pipeline parallelism), driven like `EngineCore`'s
batch queue: each batch runs on the fake runner when it is scheduled, but its output reaches the
scheduler only when the batch leaves the queue. The tokens must be those of the fake model run
alone, also when requests are preempted while one of their batches is in flight."""

from __future__ import annotations

import random
from collections import deque

from fake_runner import FakeRunner, assert_all_blocks_free, make_request, make_scheduler
from test_scheduler import expected_tokens

from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler


def run_pipelined(s: Scheduler, runner: FakeRunner, depth: int) -> tuple[dict[str, list[int]], list[int], int]:
    """Every request's tokens, the number of requests of each batch, and how many requests were
    preempted while a batch of theirs was in flight."""
    # Each batch in flight, its output, and the requests that sample in it.
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput, set[str]]] = deque()
    tokens: dict[str, list[int]] = {}
    batches: list[int] = []
    preempted_in_flight = 0
    while s.has_unfinished_requests() or queue:
        if len(queue) < depth and s.has_unfinished_requests():
            so = s.schedule()
            if so.total_num_scheduled_tokens or so.preempted_req_ids:
                cached = so.scheduled_cached_reqs
                # No request runs again before the token it samples in a batch in flight is in; the next
                # chunk of a prompt may follow the previous one at once.
                sampling = {r for _, _, samplers in queue for r in samplers}
                assert sampling.isdisjoint(so.num_scheduled_tokens)
                samplers = {r for r in so.num_scheduled_tokens if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens}
                # The input tokens travel with the batch (what the stages that do not sample read).
                for req_id, start, ids in zip(cached.req_ids, cached.num_computed_tokens, cached.token_ids, strict=True):
                    assert runner.reqs[req_id].tokens[start : start + len(ids)] == ids
                    assert len(ids) == so.num_scheduled_tokens[req_id]
                batches.append(len(so.num_scheduled_tokens))
                preempted_in_flight += sum(any(r in b.num_scheduled_tokens for b, _, _ in queue) for r in so.preempted_req_ids)
                queue.append((so, runner.execute_model(so), samplers))
                if len(queue) < depth:
                    continue
            else:
                s.finished_req_ids |= so.finished_req_ids
        so, output, _ = queue.popleft()
        for o in s.update_from_output(so, output).outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, batches, preempted_in_flight


def test_decodes_split_evenly_over_the_batches_in_flight() -> None:
    s = make_scheduler(max_concurrent_batches=2)
    runner = FakeRunner(s.block_size)
    prompts = {f"r{i}": [i + 1, i + 2, i + 3] for i in range(5)}
    for req_id, prompt in prompts.items():
        s.add_request(make_request(s, req_id, prompt, max_tokens=6))
    tokens, batches, _ = run_pipelined(s, runner, depth=2)
    assert tokens == {r: expected_tokens(p, 6) for r, p in prompts.items()}
    # Five requests over two batches: 3 and 2 at a time (one batch of five would idle a stage).
    assert set(batches) == {2, 3}
    assert_all_blocks_free(s)


def test_same_tokens_with_chunked_prompts_and_preemption_in_flight() -> None:
    rng = random.Random(0)
    for depth in (2, 3):
        # Few blocks: requests are preempted, some while a batch of theirs is still in flight.
        s = make_scheduler(num_blocks=18, max_num_batched_tokens=12, max_concurrent_batches=depth)
        runner = FakeRunner(s.block_size)
        prompts = {f"r{i}": [rng.randrange(1, 900) for _ in range(rng.randrange(2, 30))] for i in range(8)}
        for req_id, prompt in prompts.items():
            s.add_request(make_request(s, req_id, prompt, max_tokens=12))
        tokens, _, preempted_in_flight = run_pipelined(s, runner, depth)
        assert tokens == {r: expected_tokens(p, 12) for r, p in prompts.items()}
        assert preempted_in_flight > 0
        assert_all_blocks_free(s)


def test_request_preempted_in_flight_waits_for_its_batch_and_recomputes() -> None:
    s = make_scheduler(max_concurrent_batches=3)
    runner = FakeRunner(s.block_size)
    prompt = [5, 6, 7]
    s.add_request(make_request(s, "a", prompt, max_tokens=3))
    b1 = s.schedule()  # the prefill, in flight
    out1 = runner.execute_model(b1)
    # A later batch preempts "a" (as when the cache runs out) while b1 is still in the pipeline.
    request = s.requests["a"]
    s.running.remove(request)
    s._preempt(request)
    del runner.reqs["a"]  # the runner drops it with the batch that preempts it
    b2 = s.schedule()
    assert b2.num_scheduled_tokens == {}  # not resumed before b1's output is in
    runner.execute_model(b2)
    s.update_from_output(b1, out1)
    # b1's token is dropped (the runner forgot "a" at its preemption): "a" recomputes and samples again.
    assert request.output_token_ids == []
    b3 = s.schedule()
    assert b3.scheduled_new_reqs[0].token_ids == prompt
    out = s.update_from_output(b3, runner.execute_model(b3))
    assert out.outputs[0].new_token_ids == expected_tokens(prompt, 1)
