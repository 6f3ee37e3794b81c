"""Beam search over the engine, as vLLM runs it: each step asks the engine for one token of every live
beam with its 2 * beam_width most likely next tokens (prefix caching makes the repeated prompts cheap),
and keeps the beam_width best extensions of each prompt by length-penalised cumulative logprob.

`BeamSearchSequence` and `BeamSearchOutput` are vLLM's result types (`LLM.beam_search`); `BeamSearch`
holds one prompt's search, driven by the offline API (`LLM.beam_search`) or by the server
(`use_beam_search`) through `step_params` and `advance`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens followed by the generated ones (vLLM's fields)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    # The decoded prompt and continuation (set on the returned beams).
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """vLLM's (and HF transformers' older) beam score: the cumulative logprob over the sequence's length
    (prompt included, a final EOS not) to the power ``length_penalty``."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What one step asks of the engine for each live beam."""
    return SamplingParams(
        n=1, max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature, ignore_eos=True
    )


def check_beam_search_params(params: BeamSearchParams) -> None:
    if isinstance(params.beam_width, bool) or not isinstance(params.beam_width, int) or params.beam_width < 1:
        raise RequestError("beam_width", f"beam_width must be a positive integer, got {params.beam_width!r}")
    if isinstance(params.max_tokens, bool) or not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise RequestError("max_tokens", f"max_tokens must be a positive integer, got {params.max_tokens!r}")


@dataclass
class BeamSearch:
    """One prompt's search. ``max_model_len`` ends the beams that fill the context."""

    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_id: int | None
    max_model_len: int
    lora_request: Any = None
    beams: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        check_beam_search_params(self.params)
        self.beams = [BeamSearchSequence(list(self.prompt_token_ids), [], lora_request=self.lora_request)]
        self._retire_full_beams()

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def _score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty
        )

    def advance(self, next_logprobs: list[dict[int, Logprob] | None]) -> None:
        """Extend every live beam (in `beams` order) by each candidate the engine returned for it; keep
        the beam_width best, moving the ones that ended with EOS to the completed."""
        candidates: list[BeamSearchSequence] = []
        for beam, logprobs in zip(self.beams, next_logprobs, strict=True):
            if logprobs is None:  # the engine ended it (it filled the context)
                self.completed.append(beam)
                continue
            for token_id, logprob in logprobs.items():
                extended = BeamSearchSequence(
                    tokens=[*beam.tokens, token_id],
                    logprobs=[*beam.logprobs, logprobs],
                    cum_logprob=beam.cum_logprob + logprob.logprob,
                    lora_request=beam.lora_request,
                )
                if token_id == self.eos_token_id and not self.params.ignore_eos:
                    extended.finish_reason = "stop"
                    self.completed.append(extended)
                else:
                    candidates.append(extended)
        candidates.sort(key=self._score, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps += 1
        self._retire_full_beams()

    def _retire_full_beams(self) -> None:
        # A beam that fills the context cannot be extended: it is as long as it gets.
        full = [beam for beam in self.beams if len(beam.tokens) >= self.max_model_len]
        if full:
            self.completed.extend(full)
            self.beams = [beam for beam in self.beams if len(beam.tokens) < self.max_model_len]

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the completed and the live beams, best first."""
        ranked = sorted([*self.completed, *self.beams], key=self._score, reverse=True)
        best = ranked[: self.params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
        return best


def beams_as_request_output(
    request_id: str, prompt_text: str | None, search: BeamSearch, tokenizer: Any
) -> RequestOutput:
    """The best beams as one finished RequestOutput (the server answers it like any other): each beam is
    a choice with the generated tokens only, its text without a final EOS, as vLLM's server writes it."""
    start = len(search.prompt_token_ids)
    outputs = []
    for index, beam in enumerate(search.best()):
        generated = beam.tokens[start:]
        shown = generated[:-1] if beam.finish_reason == "stop" else generated
        outputs.append(
            CompletionOutput(
                index=index,
                text=tokenizer.decode(shown, skip_special_tokens=True),
                token_ids=generated,
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason,
            )
        )
    return RequestOutput(request_id, prompt_text, list(search.prompt_token_ids), None, outputs, finished=True)


def run_beam_search(
    searches: list[BeamSearch], generate: Callable[[list[list[int]], list[Any]], list[RequestOutput]]
) -> None:
    """Step every search until all are done. ``generate`` runs one engine step for the given token
    sequences (with their adapters) under `step_params` and returns their outputs in order."""
    while live := [search for search in searches if not search.done]:
        beams = [beam for search in live for beam in search.beams]
        _advance(live, generate([beam.tokens for beam in beams], [beam.lora_request for beam in beams]))


async def run_beam_search_async(
    searches: list[BeamSearch],
    generate: Callable[[list[list[int]], list[Any]], Awaitable[list[RequestOutput]]],
) -> None:
    """`run_beam_search` over an async engine step."""
    while live := [search for search in searches if not search.done]:
        beams = [beam for search in live for beam in search.beams]
        _advance(live, await generate([beam.tokens for beam in beams], [beam.lora_request for beam in beams]))


def _advance(live: list[BeamSearch], outputs: list[RequestOutput]) -> None:
    start = 0
    for search in live:
        mine = outputs[start : start + len(search.beams)]
        start += len(search.beams)
        search.advance([_next_logprobs(output) for output in mine])


def _next_logprobs(output: RequestOutput) -> dict[int, Logprob] | None:
    completion = output.outputs[0]
    return completion.logprobs[0] if completion.logprobs else None
