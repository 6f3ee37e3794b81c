"""The scheduler reports when it first scheduled each request (the end of its queue time), once."""

from __future__ import annotations

import time

import msgspec
from fake_runner import FakeRunner, make_request, make_scheduler, run_until_done, step

from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs

# Long enough that a time taken in the wrong step cannot fall inside the right step's bounds.
GAP_S = 0.01


def timed_step(s: Scheduler, runner: FakeRunner) -> tuple[float, float, EngineCoreOutputs]:
    """One step with the wall-clock bounds around it, then a pause that separates it from the next."""
    before = time.time()
    _, outs = step(s, runner)
    after = time.time()
    time.sleep(GAP_S)
    return before, after, outs


def reported_times(outs: EngineCoreOutputs) -> dict[str, float | None]:
    return {o.request_id: o.first_scheduled_time for o in outs.outputs}


def test_time_of_the_first_chunk_rides_on_the_first_output() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "a", list(range(20)), max_tokens=3, arrival_time=time.time()))
    time.sleep(GAP_S)
    start, end, outs = timed_step(s, runner)
    assert outs.outputs == []  # a mid-prefill chunk reports nothing, the time included
    scheduled = s.requests["a"].first_scheduled_time
    assert scheduled is not None and start <= scheduled <= end
    assert s.requests["a"].arrival_time + GAP_S <= scheduled
    _, _, outs = timed_step(s, runner)
    assert outs.outputs == []
    # The prefill's last chunk samples the first token: that output carries the scheduling time of
    # the first chunk, two steps earlier.
    _, _, outs = timed_step(s, runner)
    assert reported_times(outs) == {"a": scheduled}
    # Later outputs of the request do not repeat it.
    _, _, outs = timed_step(s, runner)
    assert reported_times(outs) == {"a": None}
    run_until_done(s, runner)


def test_waiting_request_is_scheduled_when_a_seat_frees() -> None:
    s = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(s.block_size)
    s.add_request(make_request(s, "first", [1, 2, 3], max_tokens=2))
    s.add_request(make_request(s, "second", [4, 5, 6], max_tokens=2))
    start, end, outs = timed_step(s, runner)
    first_time = reported_times(outs)["first"]
    assert first_time is not None and start <= first_time <= end
    assert s.requests["second"].first_scheduled_time is None  # still queued: no seat
    _, _, outs = timed_step(s, runner)  # "first" finishes
    assert reported_times(outs) == {"first": None}
    start, end, outs = timed_step(s, runner)
    second_time = reported_times(outs)["second"]
    assert second_time is not None and start <= second_time <= end
    run_until_done(s, runner)


def test_preemption_keeps_the_first_time_and_reports_it_once() -> None:
    # 6 blocks of 4 tokens for three 8-token prompts: "c" is preempted in the second step.
    s = make_scheduler(num_blocks=6, max_model_len=24, enable_prefix_caching=False)
    runner = FakeRunner(s.block_size)
    for i, req_id in enumerate("abc"):
        s.add_request(make_request(s, req_id, [10 * i + j for j in range(8)], max_tokens=8))
    _, _, outs = timed_step(s, runner)
    first = reported_times(outs)
    assert set(first) == {"a", "b", "c"} and None not in first.values()
    reports: dict[str, list[float]] = {}
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        _, outs = step(s, runner)
        for o in outs.outputs:
            if o.first_scheduled_time is not None:
                reports.setdefault(o.request_id, []).append(o.first_scheduled_time)
    assert runner.result.num_preemptions >= 1
    # The resume after the preemption is no new scheduling: nothing is reported again.
    assert reports == {}
    assert not s.has_unfinished_requests()


def test_first_scheduled_time_crosses_msgpack() -> None:
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [7], first_scheduled_time=1234.5678)])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded.outputs[0].first_scheduled_time == 1234.5678
    # Absent (the default) it costs nothing on the wire and decodes as None.
    plain = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [7])])
    assert len(msgspec.msgpack.encode(plain)) < len(msgspec.msgpack.encode(outputs))
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.encode(plain), type=EngineCoreOutputs)
        .outputs[0]
        .first_scheduled_time
        is None
    )
