"""EngineCoreOutputs -> RequestOutputs: per-request detokenization, stop strings, logprobs, n > 1.

Shared by `LLMEngine` (outputs returned from `step()`) and the server's `AsyncLLM` (outputs put into a
per-request `RequestOutputCollector`). Nothing here blocks or waits: one call turns one batch of core
outputs into user-facing outputs, and reports the requests a stop string finished so the caller aborts
them in the core (the core only knows token-level stop conditions).

A request with ``n > 1`` becomes n child requests in the core (``"{index}_{request_id}"``); a
`ParentRequest` collects the children's completions and emits one `RequestOutput` per step under the
user's request id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from pagedllm.core.runner_output import LogprobsLists
from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token_ids
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.engine.request_observer import RequestObserver
from pagedllm.errors import ErrorReport
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class OutputSink(Protocol):
    """Where a request's outputs go when the caller streams them (AsyncLLM); see RequestOutputCollector."""

    def put(self, output: RequestOutput | BaseException) -> None: ...


class RequestOutputCollector:
    """A one-slot mailbox per request for asyncio consumers.

    ``put`` never blocks: when the reader falls behind, the pending output absorbs the new one (DELTA
    outputs are concatenated, cumulative/final ones replaced), so a slow client costs no memory growth.
    Use it from the event loop's thread only (asyncio.Event is not thread-safe).
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if (
            self._pending is None
            or isinstance(output, BaseException)
            or isinstance(self._pending, BaseException)
        ):
            self._pending = output
        else:
            self._pending.add(output, aggregate=self.aggregate)
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        output, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output

    async def get(self) -> RequestOutput:
        while self._pending is None:
            await self._ready.wait()
        output = self.get_nowait()
        assert output is not None
        return output


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    # Core request ids that a stop string finished: the caller must abort them in the core.
    reqs_to_abort: list[str] = field(default_factory=list)
    # User request id -> the refusal, for requests the core rejected (EngineCoreOutputs.errors).
    errors: dict[str, ErrorReport] = field(default_factory=dict)


class _LogprobsConverter:
    """LogprobsLists rows -> `{token_id: Logprob}` dicts (decoded_token is each token decoded alone)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _decode(self, token_ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        return list(decode_token_ids(self.tokenizer, token_ids))

    def convert(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        rows: list[dict[int, Logprob]] = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.sampled_token_ranks):
            texts = self._decode(token_ids)
            row = {token_ids[0]: Logprob(logprobs[0], rank, texts[0])}
            # Columns 1.. are the top-k in order, so their ranks are 1..k; a sampled token among them
            # already has its (equal) rank from column 0.
            for top_rank, (token_id, logprob, text) in enumerate(
                zip(token_ids[1:], logprobs[1:], texts[1:]), 1
            ):
                row.setdefault(token_id, Logprob(logprob, top_rank, text))
            rows.append(row)
        return rows


class RequestState:
    """One core request's progress as the user sees it."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: Any,
        converter: _LogprobsConverter,
        parent: ParentRequest | None,
        index: int,
        sink: OutputSink | None,
        stream_interval: int = 1,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.parent = parent
        self.index = index
        self.sink = sink
        self.stream_interval = stream_interval
        self.trace_headers = request.trace_headers
        # detokenize=False means no text at all, Logprob.decoded_token included (as vLLM).
        self.converter = converter if params.detokenize else _LogprobsConverter(None)
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)
            if params.detokenize and tokenizer is not None
            else None
        )
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        # How much has been handed out already (for DELTA outputs).
        self._sent_tokens = 0
        self._sent_logprobs = 0
        self._sent_prompt_logprobs = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.is_pooling = request.pooling_params is not None
        self.pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_text(self) -> str | None:
        return None if self.detokenizer is None else self.detokenizer.output_text

    def update(self, output: EngineCoreOutput, now: float) -> bool:
        """Apply one core output; True when a stop string ended the request here (abort it in the core)."""
        new_ids = output.new_token_ids
        if output.pooling_output is not None:
            self.pooling_output = output.pooling_output
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.first_scheduled_time is not None and self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = output.first_scheduled_time
        if output.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self.converter.convert(output.new_prompt_logprobs))
        if new_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
            self.metrics.num_generation_tokens += len(new_ids)
        stop_string: str | None = None
        if self.detokenizer is not None and new_ids:
            # On EOS / a stop token id the last token's text is left out (unless include_stop_str_in_output).
            stop_terminated = output.finish_reason == FinishReason.STOP
            stop_string = self.detokenizer.update(new_ids, stop_terminated, output.finish_reason is not None)
        self.token_ids.extend(new_ids)
        if output.new_logprobs is not None and self.logprobs is not None:
            rows = self.converter.convert(output.new_logprobs)[: len(new_ids)]
            self.logprobs.extend(rows)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += sum(row[token].logprob for row, token in zip(rows, new_ids))
        if stop_string is not None:
            self.finish_reason, self.stop_reason = str(FinishReason.STOP), stop_string
        elif output.finish_reason is not None:
            self.finish_reason, self.stop_reason = str(output.finish_reason), output.stop_reason
        if self.finished:
            self.metrics.finished_time = now
        return stop_string is not None and output.finish_reason is None

    def has_news(self) -> bool:
        return (
            self.finished
            or len(self.token_ids) > self._sent_tokens
            or (self.prompt_logprobs is not None and len(self.prompt_logprobs) > self._sent_prompt_logprobs)
        )

    def make_completion(self) -> CompletionOutput | None:
        """This step's completion in the request's output kind (None when there is nothing to send)."""
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if not self.has_news():
            return None
        # stream_interval > 1: the first token, then every stream_interval tokens, and the end.
        held = len(self.token_ids) - self._sent_tokens < self.stream_interval
        if held and self._sent_tokens and not self.finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = "" if self.detokenizer is None else self.detokenizer.get_next_output_text(self.finished, delta)
        start = self._sent_tokens if delta else 0
        log_start = self._sent_logprobs if delta else 0
        self._sent_tokens = len(self.token_ids)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[log_start:]
            self._sent_logprobs = len(self.logprobs)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        if self.prompt_logprobs is None:
            return None
        start = self._sent_prompt_logprobs if self.output_kind == RequestOutputKind.DELTA else 0
        self._sent_prompt_logprobs = len(self.prompt_logprobs)
        return self.prompt_logprobs[start:]


class ParentRequest:
    """The user's view of an n > 1 request: collects its children's completions."""

    def __init__(
        self, request_id: str, params: SamplingParams, prompt: str | None, sink: OutputSink | None
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.output_kind = params.output_kind
        self.prompt = prompt
        self.sink = sink
        self.child_ids: list[str] = [f"{index}_{request_id}" for index in range(params.n)]
        self.unfinished: set[str] = set(self.child_ids)
        self.latest: dict[int, CompletionOutput] = {}
        self.step_completions: list[CompletionOutput] = []
        self.prompt_token_ids: list[int] | None = None
        self.trace_headers: dict[str, str] | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self._child_tokens: dict[str, int] = {}

    def child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Child ``index`` samples one sequence; a seeded request gives child i the seed ``seed + i``
        (modulo 2**64, the generators' seed range), so its choices are reproducible run to run."""
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = (params.seed + index) % 2**64
        return child

    def collect(self, state: RequestState, completion: CompletionOutput | None) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=state.metrics.arrival_time)
            self.prompt_token_ids, self.trace_headers = state.prompt_token_ids, state.trace_headers
        self._merge_metrics(state.request_id, state.metrics)
        self.num_cached_tokens = max(self.num_cached_tokens, state.num_cached_tokens)
        if state.index == 0 and state.prompt_logprobs is not None:
            piece = state.take_prompt_logprobs()
            if self.output_kind == RequestOutputKind.DELTA and self.prompt_logprobs is not None:
                # A DELTA piece not sent yet (no output was made since): the new one continues it.
                self.prompt_logprobs = [*self.prompt_logprobs, *(piece or [])]
            else:
                # Cumulative and final outputs take every row so far from the child.
                self.prompt_logprobs = piece
        if completion is not None:
            self.latest[completion.index] = completion
            self.step_completions.append(completion)
        if state.finished:
            self.unfinished.discard(state.request_id)

    def _merge_metrics(self, state_id: str, child: RequestMetrics) -> None:
        mine = self.metrics
        assert mine is not None
        if child.first_scheduled_time is not None:
            # The request left the queue when its first child did.
            mine.first_scheduled_time = min(
                mine.first_scheduled_time or child.first_scheduled_time, child.first_scheduled_time
            )
        if child.first_token_time is not None:
            mine.first_token_time = min(
                mine.first_token_time or child.first_token_time, child.first_token_time
            )
        if child.last_token_time is not None:
            mine.last_token_time = max(mine.last_token_time or 0.0, child.last_token_time)
        if child.finished_time is not None:
            mine.finished_time = max(mine.finished_time or 0.0, child.finished_time)
        self._child_tokens[state_id] = child.num_generation_tokens
        mine.num_generation_tokens = sum(self._child_tokens.values())

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def make_output(self) -> RequestOutput | None:
        step, self.step_completions = self.step_completions, []
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            outputs = [self.latest[i] for i in sorted(self.latest)]
        elif self.output_kind == RequestOutputKind.DELTA:
            outputs = sorted(step, key=lambda c: c.index)
        else:
            outputs = [self.latest[i] for i in sorted(self.latest)]
        if not outputs and not self.finished:
            return None
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            self.prompt_logprobs = None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """Turns core outputs into user outputs for every live request."""

    def __init__(
        self, tokenizer: Any, stream_interval: int = 1, observer: RequestObserver | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        # Request logs and traces (None when neither is on).
        self.observer = observer
        self._converter = _LogprobsConverter(tokenizer)
        # Core request id -> state (children of n > 1 requests are here under their own ids).
        self.request_states: dict[str, RequestState] = {}
        # User request id -> parent, for n > 1 requests.
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        sink: OutputSink | None = None,
    ) -> None:
        """Track a core request (for a child, pass its parent and index; the sink lives on the parent)."""
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
            sink = parent.sink
        self.request_states[request.request_id] = RequestState(
            request, prompt, self.tokenizer, self._converter, parent, index, sink, self.stream_interval
        )

    def add_user_request(
        self, request: EngineCoreRequest, prompt: str | None, sink: OutputSink | None = None
    ) -> list[EngineCoreRequest]:
        """Track a user request; returns the core requests to send for it: the request itself when
        n == 1, else one child per choice (the n > 1 fan-out of both front-ends)."""
        if self.observer is not None:
            self.observer.request_added(request, prompt)
        params = request.sampling_params
        if params.n == 1:
            self.add_request(request, prompt, sink=sink)
            return [request]
        parent = ParentRequest(request.request_id, params, prompt, sink)
        children = [
            msgspec.structs.replace(
                request, request_id=child_id, sampling_params=parent.child_params(params, i)
            )
            for i, child_id in enumerate(parent.child_ids)
        ]
        for i, child in enumerate(children):
            self.add_request(child, prompt, parent=parent, index=i)
        return children

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget user requests (plain or n > 1 parents); returns the core ids to abort in the core."""
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            ids = parent.child_ids if parent is not None else [request_id]
            for core_id in ids:
                if self.request_states.pop(core_id, None) is not None:
                    core_ids.append(core_id)
        return core_ids

    def process_outputs(self, outputs: EngineCoreOutputs | list[EngineCoreOutput]) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        if isinstance(outputs, EngineCoreOutputs):
            core_outputs = list(outputs.outputs)
            # Rejected requests are finished as aborted, with the reason reported by user request id.
            for core_id, report in outputs.errors.items():
                state = self.request_states.get(core_id)
                if state is not None:
                    user_id = state.parent.request_id if state.parent is not None else core_id
                    result.errors[user_id] = report
                    core_outputs.append(EngineCoreOutput(core_id, [], finish_reason=FinishReason.ABORT))
        else:
            core_outputs = outputs
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        for output in core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                # Aborted by the user while this output was on its way.
                continue
            if state.update(output, now):
                result.reqs_to_abort.append(state.request_id)
            completion = state.make_completion()
            if state.finished:
                del self.request_states[state.request_id]
                if self.observer is not None:
                    self.observer.sequence_finished(state)
            if state.parent is not None:
                state.parent.collect(state, completion)
                touched[state.parent.request_id] = state.parent
            elif completion is not None:
                self._emit(result, state.sink, self._make_output(state, completion))
        for parent in touched.values():
            request_output = parent.make_output()
            if parent.finished:
                self.parent_requests.pop(parent.request_id, None)
                if self.observer is not None:
                    self.observer.request_finished(parent)
            if request_output is not None:
                self._emit(result, parent.sink, request_output)
        return result

    @staticmethod
    def _make_output(
        state: RequestState, completion: CompletionOutput
    ) -> RequestOutput | PoolingRequestOutput:
        if state.is_pooling:
            # An aborted pooling request has no output: its data stays empty.
            data = state.pooling_output if state.pooling_output is not None else []
            return PoolingRequestOutput(
                state.request_id, PoolingOutput(data), state.prompt_token_ids, state.finished
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.take_prompt_logprobs(),
            outputs=[completion],
            finished=state.finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
        )

    @staticmethod
    def _emit(
        result: OutputProcessorOutput, sink: OutputSink | None, output: RequestOutput | PoolingRequestOutput
    ) -> None:
        if sink is None:
            result.request_outputs.append(output)
        else:
            sink.put(output)
