"""What the offline API and the server hand back for a request (vLLM's RequestOutput family)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The log probability of one token, with its rank in the vocabulary (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per output token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Times (seconds, time.time() clock) of a request's life, filled in by the front-end."""

    arrival_time: float
    # When the engine core's scheduler first scheduled the request (reported with its first output).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """Arrival to first scheduled: the wait for the engine, without the prefill."""
        if self.first_scheduled_time is None:
            return None
        # The core's clock is another process's reading of the wall clock: never report a negative wait.
        return max(self.first_scheduled_time - self.arrival_time, 0.0)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    # vLLM's phases (as its request spans report them): first scheduled -> first token (prefill),
    # first -> last token (decode), first scheduled -> last token (inference). Clamped like the queue
    # time: the scheduling time is the core process's reading of the clock.
    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return max(self.first_token_time - self.first_scheduled_time, 0.0)

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        if self.first_scheduled_time is None or self.last_token_time is None:
            return None
        return max(self.last_token_time - self.first_scheduled_time, 0.0)


@dataclass
class CompletionOutput:
    """One output sequence of a request (there are n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    # "stop" (EOS, stop token or stop string), "length" (max_tokens / context) or "abort"; None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence; None for EOS or any other reason.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    """The output of a request so far: its prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request (streaming n > 1: children report one at a time).

        With ``aggregate`` (DELTA outputs collected between two reads) the new text, tokens and logprobs
        are appended to the completion of the same index, and new prompt logprobs to the prompt's;
        otherwise that completion (and the prompt logprobs, when given) is replaced."""
        self.finished |= next_output.finished
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.prompt_logprobs is not None:
            # Over a chunked prefill the prompt's logprobs come in pieces: DELTA pieces add up, while a
            # cumulative output already holds every row so far.
            if aggregate and self.prompt_logprobs is not None:
                self.prompt_logprobs = [*self.prompt_logprobs, *next_output.prompt_logprobs]
            else:
                self.prompt_logprobs = next_output.prompt_logprobs
        for completion in next_output.outputs:
            for i, mine in enumerate(self.outputs):
                if mine.index != completion.index:
                    continue
                if aggregate:
                    mine.text += completion.text
                    mine.token_ids = [*mine.token_ids, *completion.token_ids]
                    if completion.logprobs is not None:
                        mine.logprobs = [*(mine.logprobs or []), *completion.logprobs]
                    mine.cumulative_logprob = completion.cumulative_logprob
                    mine.finish_reason = completion.finish_reason
                    mine.stop_reason = completion.stop_reason
                else:
                    self.outputs[i] = completion
                break
            else:
                self.outputs.append(completion)
        self.outputs.sort(key=lambda c: c.index)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, finished={self.finished}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


@dataclass
class PoolingOutput:
    """The pooled output of a pooling request (vLLM's `PoolingOutput`)."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """The output of a pooling request: an embedding, class probabilities or a score."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    def add(self, next_output: PoolingRequestOutput, aggregate: bool) -> None:
        """A pooling request has one output; a later one replaces it."""
        self.outputs, self.finished = next_output.outputs, next_output.finished


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data), output.prompt_token_ids, output.finished)


@dataclass
class ClassificationOutput:
    probs: list[float]


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(
            output.request_id, ClassificationOutput(output.outputs.data), output.prompt_token_ids, output.finished
        )


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
