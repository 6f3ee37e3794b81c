"""RequestOutput / CompletionOutput / RequestMetrics behaviour."""

from __future__ import annotations

from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _completion(index: int, text: str, ids: list[int], finish: str | None = None) -> CompletionOutput:
    logprobs = [{t: Logprob(-0.5, rank=1, decoded_token=str(t))} for t in ids]
    return CompletionOutput(
        index, text, ids, cumulative_logprob=-0.5 * len(ids), logprobs=logprobs, finish_reason=finish
    )


def _output(completions: list[CompletionOutput], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], None, completions, finished, RequestMetrics(arrival_time=1.0))


def test_add_aggregates_deltas_per_index() -> None:
    out = _output([_completion(0, "a", [5])])
    out.add(_output([_completion(1, "x", [7])]), aggregate=True)
    out.add(_output([_completion(0, "b", [6], finish="length")]), aggregate=True)
    assert [c.index for c in out.outputs] == [0, 1]
    first = out.outputs[0]
    assert (first.text, first.token_ids, first.finish_reason) == ("ab", [5, 6], "length")
    assert first.logprobs is not None and [list(d) for d in first.logprobs] == [[5], [6]]
    assert first.cumulative_logprob == -0.5 and first.finished()
    assert not out.finished
    out.add(_output([_completion(1, "y", [8], finish="stop")], finished=True), aggregate=True)
    assert out.finished and out.outputs[1].text == "xy"


def test_add_replaces_cumulative_outputs() -> None:
    out = _output([_completion(0, "a", [5])])
    out.add(_output([_completion(0, "ab", [5, 6])]), aggregate=False)
    assert out.outputs[0].text == "ab" and out.outputs[0].token_ids == [5, 6]
    assert not out.outputs[0].finished()


def test_metrics_latencies() -> None:
    m = RequestMetrics(arrival_time=10.0)
    assert m.time_to_first_token is None and m.e2e_latency is None
    m.first_token_time, m.finished_time = 11.0, 13.0
    assert (m.time_to_first_token, m.e2e_latency) == (1.0, 3.0)
