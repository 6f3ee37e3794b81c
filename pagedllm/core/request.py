"""The engine core's view of one request: its tokens, progress through the KV cache, and status."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from pagedllm.core.outputs import FinishReason
from pagedllm.errors import RequestError
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.hashing import BlockHash


class GrammarState(Protocol):
    """A request's structured-output grammar as the scheduler sees it (the structured_output
    package's StructuredOutputRequest; a protocol keeps core/ free of the grammar engines)."""

    def is_ready(self) -> bool: ...

    def init_matcher(self) -> None: ...

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


def validate_prompt_token_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """ValueError for a prompt the forward cannot run: empty, or with token ids outside the vocabulary.
    The front-end's check (`pagedllm.engine.input_processor`), and the engine core's for clients that
    talk to it directly."""
    if not prompt_token_ids:
        raise RequestError("prompt", "The prompt is empty: it must contain at least one token")
    if min(prompt_token_ids) >= 0 and max(prompt_token_ids) < vocab_size:
        return
    out_of_vocab = sorted({t for t in prompt_token_ids if not 0 <= t < vocab_size})
    shown = out_of_vocab[:8]
    raise RequestError(
        "prompt",
        f"prompt_token_ids contains token ids outside the vocabulary [0, {vocab_size}): {shown}"
        + (f" and {len(out_of_vocab) - len(shown)} more" if len(out_of_vocab) > len(shown) else ""),
    )


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request as the front-end sends it to the core (over ZMQ for the server)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = 0.0
    priority: int = 0
    # A pooling request (embedding, classification, score): it finishes once its prompt is computed.
    pooling_params: PoolingParams | None = None
    # The W3C trace-context headers the client sent (traceparent, tracestate): the parent of the
    # request's `llm_request` span when tracing is on.
    trace_headers: dict[str, str] | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Waiting for its structured-output grammar to compile (not yet in the waiting queue).
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state (see `is_finished`).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # Ignored requests never started (e.g. they could not fit); the user sees a length finish.
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.lora_request = lora_request
        # 0 for the base model: the scheduler's adapter accounting and the prefix-cache key.
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # A concrete max_tokens is set by the front-end; None (or unset) means "up to max_model_len",
        # which the scheduler enforces separately.
        max_tokens = sampling_params.max_tokens
        self.max_tokens: int | None = max_tokens if isinstance(max_tokens, int) else None
        # Looked up once per sampled token: a frozenset, not the params' list.
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())

        self.output_token_ids: list[int] = []
        # Prompt then output tokens; appended to in place (never rebuilt) so decoding stays O(1).
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Tokens whose KV is in the cache (or scheduled to be, once `schedule()` returned).
        self.num_computed_tokens = 0
        # Draft tokens proposed after the last token, to be verified in the next step (not yet part of
        # the sequence: a rejected draft is simply dropped).
        self.spec_token_ids: list[int] = []
        # Prompt tokens served from the prefix cache when first scheduled (-1: not scheduled yet).
        self.num_cached_tokens = -1
        # Of those, the ones a KV connector supplied (the rest were found in the local prefix cache).
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        # Wall-clock time the scheduler first scheduled the request (a resume after preemption keeps
        # it: the queue time ends once); reported to the front-end once, with the next output.
        self.first_scheduled_time: float | None = None
        self._first_scheduled_time_reported = False

        # Set by the engine core for a request with structured outputs.
        self.structured_output_request: GrammarState | None = None

        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, block_hasher: Callable[[Request], list[BlockHash]] | None
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            lora_request=request.lora_request,
            block_hasher=block_hasher,
            pooling_params=request.pooling_params,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens the next step may run: the sequence plus the drafts awaiting verification."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            # Output tokens fill blocks too: hashing them lets a preempted request (and a follow-up
            # turn of a conversation) hit its own earlier output in the prefix cache.
            self.block_hashes.extend(self._block_hasher(self))

    def take_first_scheduled_time(self) -> float | None:
        """The first-scheduled time, the first time it is asked for once known; None afterwards."""
        if self.first_scheduled_time is None or self._first_scheduled_time_reported:
            return None
        self._first_scheduled_time_reported = True
        return self.first_scheduled_time

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        """Admission order of the "priority" policy: lower priority value first, then earlier arrival
        (request id breaks exact ties so the heap order is total)."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
