"""`LLMEngine`: the synchronous front-end (vLLM's API) over an EngineCore client.

The engine owns no scheduling or model state: it validates and tokenizes requests (`InputProcessor`),
hands them to the core through a small client object, and turns what the core returns into
`RequestOutput`s (`OutputProcessor`). The client is in-process here (`InprocClient` calls
`EngineCore.step()` directly); anything with the same four methods works, which keeps the front-end
independent of where the core runs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.config.support import check_in_process
from pagedllm.config.watermark_check import check_supports_watermarking
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.engine.request_observer import RequestObserver
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.config.args import EngineArgs


class EngineCoreClient(Protocol):
    """What `LLMEngine` needs from the core, wherever it runs."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs: ...

    def has_unfinished_requests(self) -> bool: ...

    def reset_prefix_cache(self) -> bool: ...

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run an engine operation by name (`pagedllm.engine.utility.UTILITY_METHODS`)."""
        ...

    def shutdown(self) -> None: ...


# The longest an in-process engine sleeps waiting for a grammar before it looks again.
_GRAMMAR_POLL_S = 0.2


class InprocClient:
    """The core in this process: `get_output()` runs one engine step."""

    def __init__(self, engine_config: EngineConfig) -> None:
        # Imported here: building the core loads the model, which plain front-end users (and the
        # processors' tests) never need.
        from pagedllm.engine.core import EngineCore

        check_in_process(engine_config)
        self.core = EngineCore(engine_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        # While every request waits for its grammar, sleep until one compiles rather than spin.
        self.core.wait_for_grammars(timeout=_GRAMMAR_POLL_S)
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return bool(self.core.reset_prefix_cache())

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.core.call_utility(method, args, kwargs)

    def shutdown(self) -> None:
        self.core.shutdown()


class LLMEngine:
    def __init__(
        self,
        engine_config: EngineConfig,
        engine_core: EngineCoreClient | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        if tokenizer is None and not getattr(self.model_config, "skip_tokenizer_init", False):
            from pagedllm.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(self.model_config)
        # Without a tokenizer (skip_tokenizer_init) prompts must be token ids and outputs carry no text.
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(
            self.model_config,
            tokenizer,
            engine_config.structured_outputs_config,
            functools.partial(check_supports_watermarking, engine_config),
            engine_config.scheduler_config.policy,
        )
        self.observer = RequestObserver.from_config(
            engine_config, None, engine_config.logging_config.enable_log_requests
        )
        self.output_processor = OutputProcessor(
            tokenizer, engine_config.scheduler_config.stream_interval, self.observer
        )
        self.engine_core: EngineCoreClient = (
            engine_core if engine_core is not None else InprocClient(engine_config)
        )
        # The core's latest counters (running/waiting, KV usage, prefix cache hits), for callers' logs.
        self.scheduler_stats: SchedulerStats | None = None
        # Outputs held back when a step raised for a refused request (see step()).
        self._undelivered: list[RequestOutput] = []
        # LoRA adapters the core has read and checked (each is checked before its first request).
        self._loras: set[int] = set()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request (ValueError with the reason when it is not acceptable);
        ``trace_headers`` (W3C traceparent/tracestate) make its trace span a child of the caller's."""
        if (
            request_id in self.output_processor.request_states
            or request_id in self.output_processor.parent_requests
        ):
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None and lora_request.lora_int_id not in self._loras:
            self.add_lora(lora_request)
        request, prompt_text = self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            arrival_time,
            priority,
            trace_headers=trace_headers,
            lora_request=lora_request,
        )
        core_requests = self.output_processor.add_user_request(request, prompt_text)
        try:
            for core_request in core_requests:
                self.engine_core.add_request(core_request)
        except Exception:
            self.abort_request(request_id)
            raise

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs it produced (finished ones have ``finished=True``).

        A request the core refused raises ValueError here; the other requests' outputs of that step are
        returned by the next call."""
        if self._undelivered:
            undelivered, self._undelivered = self._undelivered, []
            return undelivered
        outputs = self.engine_core.get_output()
        if outputs.scheduler_stats is not None:
            self.scheduler_stats = outputs.scheduler_stats
        processed = self.output_processor.process_outputs(outputs)
        # Stop strings end requests the core would otherwise keep generating for.
        self.engine_core.abort_requests(processed.reqs_to_abort)
        if processed.errors:
            self._undelivered = [o for o in processed.request_outputs if o.request_id not in processed.errors]
            details = "; ".join(f"request {rid!r}: {r.message}" for rid, r in processed.errors.items())
            raise ValueError(f"The engine rejected requests: {details}")
        if (
            not outputs.outputs
            and self.output_processor.has_unfinished_requests()
            and not self.engine_core.has_unfinished_requests()
        ):
            # Nothing left to run but requests still waiting for output: looping would never end.
            lost = sorted(self.output_processor.request_states)
            raise RuntimeError(
                f"The engine core has no record of requests {lost[:8]} that are still unfinished"
            )
        return processed.request_outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by the ids given to add_request (no further outputs are produced for them)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._undelivered) or self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Unfinished requests as the core sees them (an n > 1 request counts n times)."""
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """An engine operation by name: sleep mode, weight updates, profiling, worker RPCs."""
        return self.engine_core.call_utility(method, *args, **kwargs)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check a LoRA adapter in the engine (ValueError naming the problem); False if it
        was loaded already."""
        added = bool(self.call_utility("add_lora", lora_request))
        self._loras.add(lora_request.lora_int_id)
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (ValueError while an unfinished request uses it)."""
        removed = bool(self.call_utility("remove_lora", lora_int_id))
        self._loras.discard(lora_int_id)
        return removed

    def list_loras(self) -> set[int]:
        return set(self.call_utility("list_loras"))

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        if self.observer is not None:
            self.observer.shutdown()
