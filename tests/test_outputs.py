"""RequestOutput / CompletionOutput / RequestMetrics behaviour."""

from __future__ import annotations

from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput


def _completion(index: int, text: str, ids: list[int], finish: str | None = None) -> CompletionOutput:
    logprobs = [{t: Logprob(-0.5, rank=1, decoded_token=str(t))} for t in ids]
    return CompletionOutput(
        index, text, ids, cumulative_logprob=-0.5 * len(ids), logprobs=logprobs, finish_reason=finish
    )


def _output(
    completions: list[CompletionOutput], finished: bool = False, prompt_logprobs: PromptLogprobs | None = None
) -> RequestOutput:
    return RequestOutput(
        "r", "p", [1, 2, 3], prompt_logprobs, completions, finished, RequestMetrics(arrival_time=1.0)
    )


def _prompt_row(token: int) -> dict[int, Logprob]:
    return {token: Logprob(-1.0 * token, rank=1)}


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


def test_add_concatenates_prompt_logprob_pieces_of_deltas() -> None:
    # A slow reader of a chunked prefill: the first piece (with the first token's None), a step with
    # no new prompt rows, then the last piece together with the first sampled token.
    out = _output([_completion(0, "", [])], prompt_logprobs=[None])
    out.add(_output([_completion(0, "", [])]), aggregate=True)
    out.add(_output([_completion(0, "", [])], prompt_logprobs=[_prompt_row(2)]), aggregate=True)
    out.add(_output([_completion(0, "a", [5])], prompt_logprobs=[_prompt_row(3)]), aggregate=True)
    assert out.prompt_logprobs == [None, _prompt_row(2), _prompt_row(3)]
    assert out.outputs[0].token_ids == [5]
    # Nothing pending yet: the later piece is taken as it is.
    empty = _output([_completion(0, "", [])])
    empty.add(_output([_completion(0, "a", [5])], prompt_logprobs=[_prompt_row(3)]), aggregate=True)
    assert empty.prompt_logprobs == [_prompt_row(3)]


def test_add_replaces_cumulative_prompt_logprobs() -> None:
    out = _output([_completion(0, "", [])], prompt_logprobs=[None, _prompt_row(2)])
    full = [None, _prompt_row(2), _prompt_row(3)]
    out.add(_output([_completion(0, "a", [5])], prompt_logprobs=full), aggregate=False)
    assert out.prompt_logprobs == full
    # An output without prompt logprobs leaves them as they were.
    out.add(_output([_completion(0, "ab", [5, 6])]), aggregate=False)
    assert out.prompt_logprobs == full


def test_metrics_latencies() -> None:
    m = RequestMetrics(arrival_time=10.0)
    assert m.time_to_first_token is None and m.e2e_latency is None and m.time_in_queue is None
    m.first_scheduled_time, m.first_token_time, m.finished_time = 10.25, 11.0, 13.0
    assert (m.time_in_queue, m.time_to_first_token, m.e2e_latency) == (0.25, 1.0, 3.0)
    # The core's clock stepped back: no negative wait.
    m.first_scheduled_time = 9.0
    assert m.time_in_queue == 0.0
