"""OutputProcessor: output kinds, stop strings, logprobs, prompt logprobs, n > 1 parents, aborts, errors."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from pagedllm.core.runner_output import LogprobsLists
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest, RequestOutputCollector
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.errors import ErrorReport
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import get_tokenizer

PROMPT = "The weather today"
TEXT = " is sunny. Later, rain."


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    return get_tokenizer(smollm2_gguf)


def make_request(tokenizer: Any, request_id: str = "r", **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tokenizer.encode(PROMPT),
        sampling_params=SamplingParams(**params),
        eos_token_id=tokenizer.eos_token_id,
        arrival_time=100.0,
    )


def feed(
    processor: OutputProcessor, request_id: str, token_ids: list[int], last: FinishReason | None = None
) -> list[list[RequestOutput]]:
    """One core output per token, the last one finishing with ``last``; the outputs of every step."""
    steps = []
    for i, token in enumerate(token_ids):
        reason = last if i == len(token_ids) - 1 else None
        result = processor.process_outputs(
            EngineCoreOutputs([EngineCoreOutput(request_id, [token], finish_reason=reason)])
        )
        steps.append(result.request_outputs)
    return steps


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(tokenizer: Any, kind: RequestOutputKind) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, output_kind=kind), PROMPT)
    ids = tokenizer.encode(TEXT)
    steps = feed(processor, "r", ids, FinishReason.LENGTH)
    outputs = [o for step in steps for o in step]
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert final.prompt == PROMPT and final.prompt_token_ids == tokenizer.encode(PROMPT)
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    else:
        assert len(outputs) == len(ids)
    if kind == RequestOutputKind.DELTA:
        assert "".join(o.outputs[0].text for o in outputs) == TEXT
        assert [t for o in outputs for t in o.outputs[0].token_ids] == ids
    else:
        assert final.outputs[0].text == TEXT and final.outputs[0].token_ids == ids
        if kind == RequestOutputKind.CUMULATIVE:
            assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, len(ids) + 1))
    metrics = final.metrics
    assert metrics is not None and metrics.arrival_time == 100.0
    assert metrics.first_token_time is not None and metrics.finished_time is not None
    assert metrics.num_generation_tokens == len(ids)
    assert not processor.has_unfinished_requests()


def test_stop_string_aborts_in_core_and_cuts_text(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, stop=[". L", "rain"]), PROMPT)
    ids = tokenizer.encode(TEXT)
    aborted: list[str] = []
    finals = []
    for token in ids:
        result = processor.process_outputs([EngineCoreOutput("r", [token])])
        aborted += result.reqs_to_abort
        finals += [o for o in result.request_outputs if o.finished]
    assert aborted == ["r"]
    (final,) = finals
    completion = final.outputs[0]
    assert completion.text == " is sunny"
    assert (completion.finish_reason, completion.stop_reason) == ("stop", ". L")
    assert not processor.has_unfinished_requests()


def test_stop_string_kept_when_asked(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, stop="sunny", include_stop_str_in_output=True), PROMPT)
    finals = [o for step in feed(processor, "r", tokenizer.encode(TEXT)) for o in step if o.finished]
    assert finals[0].outputs[0].text == " is sunny"


def test_eos_text_left_out(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, skip_special_tokens=False), PROMPT)
    ids = [*tokenizer.encode(" Yes"), tokenizer.eos_token_id]
    final = feed(processor, "r", ids, FinishReason.STOP)[-1][0]
    assert final.outputs[0].text == " Yes"
    assert final.outputs[0].token_ids == ids
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", None)


def test_logprobs_and_prompt_logprobs(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    request = make_request(tokenizer, logprobs=2, prompt_logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request(request, PROMPT)
    a, b, c = tokenizer.encode(" one two three")
    num_prompt = len(request.prompt_token_ids)
    # Prompt logprobs arrive in two chunks (chunked prefill): num_prompt - 1 rows in all.
    p_ids = request.prompt_token_ids[1:]
    chunk1 = LogprobsLists([[t, 7] for t in p_ids[:1]], [[-1.0, -0.5]], [3])
    chunk2 = LogprobsLists(
        [[t, 7] for t in p_ids[1:]], [[-2.0, -0.1]] * (num_prompt - 2), [2] * (num_prompt - 2)
    )
    processor.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=chunk1)])
    step1 = LogprobsLists([[a, a, b]], [[-0.25, -0.25, -1.5]], [1])
    step2 = LogprobsLists([[c, a, b]], [[-3.0, -0.5, -1.0]], [4])
    processor.process_outputs([EngineCoreOutput("r", [a], new_logprobs=step1, new_prompt_logprobs=chunk2)])
    result = processor.process_outputs(
        [EngineCoreOutput("r", [c], new_logprobs=step2, finish_reason=FinishReason.LENGTH)]
    )
    (output,) = result.request_outputs
    completion = output.outputs[0]
    assert completion.token_ids == [a, c]
    assert math.isclose(completion.cumulative_logprob, -3.25)
    first, second = completion.logprobs
    assert set(first) == {a, b} and (first[a].logprob, first[a].rank) == (-0.25, 1)
    assert (first[b].rank, first[b].decoded_token) == (2, tokenizer.decode([b]))
    assert list(second) == [c, a, b] and [second[t].rank for t in (c, a, b)] == [4, 1, 2]
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == num_prompt
    assert prompt_logprobs[0] is None
    assert prompt_logprobs[1][p_ids[0]].rank == 3 and prompt_logprobs[1][7].rank == 1
    assert [row[t].logprob for row, t in zip(prompt_logprobs[2:], p_ids[1:])] == [-2.0] * (num_prompt - 2)


def test_no_detokenize_gives_ids_only(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, detokenize=False), PROMPT)
    ids = tokenizer.encode(TEXT)
    final = feed(processor, "r", ids, FinishReason.LENGTH)[-1][0]
    assert final.outputs[0].text == "" and final.outputs[0].token_ids == ids
    # Logprobs come without decoded tokens as well; a detokenizing request next to it still gets them.
    processor.add_request(make_request(tokenizer, "ids", detokenize=False, logprobs=1), PROMPT)
    processor.add_request(make_request(tokenizer, "text", logprobs=1), PROMPT)
    lists = LogprobsLists([[ids[0], ids[1]]], [[-0.5, -0.25]], [2])
    result = processor.process_outputs(
        [
            EngineCoreOutput(rid, [ids[0]], new_logprobs=lists, finish_reason=FinishReason.LENGTH)
            for rid in ("ids", "text")
        ]
    )
    rows = {o.request_id: o.outputs[0].logprobs[0] for o in result.request_outputs}
    assert [lp.decoded_token for lp in rows["ids"].values()] == [None, None]
    assert [lp.decoded_token for lp in rows["text"].values()] == [tokenizer.decode([t]) for t in ids[:2]]


def add_parent(
    processor: OutputProcessor,
    tokenizer: Any,
    kind: RequestOutputKind,
    n: int = 2,
    seed: int | None = None,
    sink: RequestOutputCollector | None = None,
    **params: Any,
) -> ParentRequest:
    request = make_request(tokenizer, "p", n=n, output_kind=kind, seed=seed, **params)
    parent = ParentRequest("p", request.sampling_params, PROMPT, sink=sink)
    for index, child_id in enumerate(parent.child_ids):
        child = EngineCoreRequest(
            child_id,
            request.prompt_token_ids,
            parent.child_params(request.sampling_params, index),
            request.eos_token_id,
            arrival_time=request.arrival_time,
        )
        processor.add_request(child, PROMPT, parent, index)
    return parent


def test_child_params() -> None:
    params = SamplingParams(n=3, seed=10, temperature=0.8)
    parent = ParentRequest("p", params, None, None)
    assert parent.child_ids == ["0_p", "1_p", "2_p"]
    children = [parent.child_params(params, i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12] and all(c.n == 1 for c in children)
    assert params.n == 3 and params.seed == 10
    assert parent.child_params(SamplingParams(n=2), 1).seed is None
    # Seeds stay in the generators' 64-bit range at its top (the runner cannot seed 2**64).
    top = SamplingParams(n=3, seed=2**64 - 2, temperature=0.8)
    assert [parent.child_params(top, i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_parent_aggregates_children(tokenizer: Any, kind: RequestOutputKind) -> None:
    processor = OutputProcessor(tokenizer)
    add_parent(processor, tokenizer, kind)
    x, y, z = tokenizer.encode(" red green blue")
    steps = [
        [EngineCoreOutput("1_p", [x]), EngineCoreOutput("0_p", [y])],
        [EngineCoreOutput("1_p", [z], finish_reason=FinishReason.LENGTH), EngineCoreOutput("0_p", [z])],
        [EngineCoreOutput("0_p", [x], finish_reason=FinishReason.LENGTH)],
    ]
    outputs = [processor.process_outputs(step).request_outputs for step in steps]
    assert all(len(step) <= 1 for step in outputs)
    flat = [o for step in outputs for o in step]
    assert all(o.request_id == "p" for o in flat)
    final = flat[-1]
    assert final.finished and [o.finished for o in flat[:-1]] == [False] * (len(flat) - 1)
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(flat) == 1
    if kind == RequestOutputKind.DELTA:
        assert [[c.index for c in o.outputs] for o in flat] == [[0, 1], [0, 1], [0]]
        assert [[c.token_ids for c in o.outputs] for o in flat][1] == [[z], [z]]
    else:
        assert [c.index for c in final.outputs] == [0, 1]
        assert [c.token_ids for c in final.outputs] == [[y, z, x], [x, z]]
        assert [c.finish_reason for c in final.outputs] == ["length", "length"]
    assert final.metrics is not None and final.metrics.num_generation_tokens == 5
    assert not processor.has_unfinished_requests() and not processor.parent_requests


def test_abort_parent_and_late_outputs(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    add_parent(processor, tokenizer, RequestOutputKind.CUMULATIVE, n=3)
    processor.add_request(make_request(tokenizer, "solo"), PROMPT)
    assert processor.get_num_unfinished_requests() == 4
    assert sorted(processor.abort_requests(["p", "unknown"])) == ["0_p", "1_p", "2_p"]
    # Outputs already on their way for aborted requests are dropped.
    result = processor.process_outputs([EngineCoreOutput("0_p", [5]), EngineCoreOutput("solo", [5])])
    assert [o.request_id for o in result.request_outputs] == ["solo"]
    assert processor.abort_requests(["solo"]) == ["solo"]
    assert not processor.has_unfinished_requests()


def test_core_errors_finish_requests(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, "bad"), PROMPT)
    add_parent(processor, tokenizer, RequestOutputKind.FINAL_ONLY)
    errors = {"bad": ErrorReport("too long", "prompt"), "1_p": ErrorReport("no room")}
    result = processor.process_outputs(EngineCoreOutputs([], errors=errors))
    assert result.errors == {"bad": errors["bad"], "p": errors["1_p"]}
    (output,) = result.request_outputs
    assert output.request_id == "bad" and output.outputs[0].finish_reason == "abort"
    assert set(processor.request_states) == {"0_p"}


def test_duplicate_request_id(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer), PROMPT)
    with pytest.raises(ValueError, match="already in use"):
        processor.add_request(make_request(tokenizer), PROMPT)


def test_collector_merges_deltas_for_a_slow_reader(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    processor.add_request(
        make_request(tokenizer, output_kind=RequestOutputKind.DELTA), PROMPT, sink=collector
    )
    ids = tokenizer.encode(TEXT)
    steps = feed(processor, "r", ids[:3])
    assert steps == [[], [], []]  # everything went to the sink

    async def read() -> RequestOutput:
        return await collector.get()

    merged = asyncio.run(read())
    assert merged.outputs[0].token_ids == ids[:3]
    assert merged.outputs[0].text == tokenizer.decode(ids[:3])
    assert collector.get_nowait() is None
    collector.put(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        collector.get_nowait()


# ------------------------------------------------------------------- prompt logprobs in pieces, queue time
def prompt_pieces(tokenizer: Any) -> tuple[LogprobsLists, LogprobsLists, list[float | None]]:
    """PROMPT's logprobs in two pieces, as over a chunked prefill, and the logprob of every prompt
    token the output should end up with (None for the first, which nothing predicts)."""
    targets = tokenizer.encode(PROMPT)[1:]
    values = [-0.5 - i for i in range(len(targets))]
    pieces = tuple(
        LogprobsLists([[t] for t in targets[part]], [[v] for v in values[part]], [1] * len(values[part]))
        for part in (slice(0, 1), slice(1, None))
    )
    return pieces[0], pieces[1], [None, *values]


def prompt_values(prompt_logprobs: Any, tokenizer: Any) -> list[float | None]:
    tokens = tokenizer.encode(PROMPT)
    return [None if row is None else row[t].logprob for row, t in zip(prompt_logprobs, tokens)]


@pytest.mark.parametrize("n", [1, 2])
def test_collector_keeps_every_prompt_logprob_piece_for_a_slow_reader(tokenizer: Any, n: int) -> None:
    processor = OutputProcessor(tokenizer)
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    kind = RequestOutputKind.DELTA
    if n == 1:
        processor.add_request(
            make_request(tokenizer, "p", prompt_logprobs=1, output_kind=kind), PROMPT, sink=collector
        )
        core_ids = ["p"]
    else:
        core_ids = add_parent(processor, tokenizer, kind, n=n, sink=collector, prompt_logprobs=1).child_ids
    first, rest, expected = prompt_pieces(tokenizer)
    a, b = tokenizer.encode(" red green")
    steps = [
        [EngineCoreOutput(i, [], new_prompt_logprobs=first) for i in core_ids],
        [EngineCoreOutput(i, [a], new_prompt_logprobs=rest) for i in core_ids],
        [EngineCoreOutput(i, [b], finish_reason=FinishReason.LENGTH) for i in core_ids],
    ]
    for step in steps:
        assert processor.process_outputs(step).request_outputs == []
    # Read once, after the whole prefill: every piece is there, once.
    merged = collector.get_nowait()
    assert merged is not None and merged.finished
    assert merged.prompt_logprobs is not None
    assert prompt_values(merged.prompt_logprobs, tokenizer) == expected
    assert [c.token_ids for c in merged.outputs] == [[a, b]] * n


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_parent_merges_prompt_logprob_pieces_of_one_batch(tokenizer: Any, kind: RequestOutputKind) -> None:
    processor = OutputProcessor(tokenizer)
    add_parent(processor, tokenizer, kind, prompt_logprobs=1)
    first, rest, expected = prompt_pieces(tokenizer)
    a, b = tokenizer.encode(" red green")
    # Both chunks of child 0 in one batch of outputs: the parent sees two pieces before it makes one
    # output from them.
    batches = [
        [
            EngineCoreOutput("0_p", [], new_prompt_logprobs=first),
            EngineCoreOutput("0_p", [a], new_prompt_logprobs=rest),
            EngineCoreOutput("1_p", [], new_prompt_logprobs=first),
            EngineCoreOutput("1_p", [b], new_prompt_logprobs=rest),
        ],
        [EngineCoreOutput(i, [a], finish_reason=FinishReason.LENGTH) for i in ("0_p", "1_p")],
    ]
    outputs = [o for batch in batches for o in processor.process_outputs(batch).request_outputs]
    if kind == RequestOutputKind.DELTA:
        pieces = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
        assert prompt_values([row for piece in pieces for row in piece], tokenizer) == expected
    else:
        final = outputs[-1]
        assert final.finished and final.prompt_logprobs is not None
        assert prompt_values(final.prompt_logprobs, tokenizer) == expected


def test_first_scheduled_time_fills_metrics(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, "solo", output_kind=RequestOutputKind.FINAL_ONLY), PROMPT)
    add_parent(processor, tokenizer, RequestOutputKind.FINAL_ONLY)
    a, b = tokenizer.encode(" red green")
    processor.process_outputs(
        [
            EngineCoreOutput("solo", [a], first_scheduled_time=100.25),
            # The second child was scheduled later, but reports first.
            EngineCoreOutput("1_p", [a], first_scheduled_time=100.75),
        ]
    )
    processor.process_outputs([EngineCoreOutput("0_p", [a], first_scheduled_time=100.5)])
    done = processor.process_outputs(
        [EngineCoreOutput(i, [b], finish_reason=FinishReason.LENGTH) for i in ("solo", "0_p", "1_p")]
    )
    metrics = {o.request_id: o.metrics for o in done.request_outputs}
    solo, parent = metrics["solo"], metrics["p"]
    assert solo is not None and parent is not None
    # The arrival is 100.0; later outputs (without a time) leave it as reported.
    assert (solo.first_scheduled_time, solo.time_in_queue) == (100.25, 0.25)
    # An n > 1 request left the queue when its first child was scheduled.
    assert (parent.first_scheduled_time, parent.time_in_queue) == (100.5, 0.5)
    assert solo.time_to_first_token is not None and solo.time_in_queue <= solo.time_to_first_token


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stream_interval_sends_every_n_tokens(tokenizer: Any, kind: RequestOutputKind) -> None:
    """stream_interval=4: the first token, then every 4 tokens, and the end; the same text as every token."""
    ids = tokenizer.encode(TEXT + TEXT)[:10]
    texts = {}
    for interval in (1, 4):
        processor = OutputProcessor(tokenizer, stream_interval=interval)
        processor.add_request(make_request(tokenizer, output_kind=kind), PROMPT)
        outputs = [o for step in feed(processor, "r", ids, FinishReason.LENGTH) for o in step]
        token_counts = [len(o.outputs[0].token_ids) for o in outputs]
        if kind == RequestOutputKind.DELTA:
            assert sum(token_counts) == len(ids)
            texts[interval] = "".join(o.outputs[0].text for o in outputs)
        else:
            texts[interval] = outputs[-1].outputs[0].text
        if interval == 1:
            assert len(outputs) == 10
        else:
            # Tokens 1, 2-5, 6-9 and the final 10th.
            expected = [1, 4, 4, 1] if kind == RequestOutputKind.DELTA else [1, 5, 9, 10]
            assert token_counts == expected and outputs[-1].finished
    assert texts[4] == texts[1] == tokenizer.decode(ids)
