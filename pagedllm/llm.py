"""The offline API: `LLM(model=...).generate(prompts)` and `.chat(messages)`, vLLM style.

All prompts of one call are queued at once and the engine is stepped until every one has finished, so
they are batched continuously; outputs come back in the order of the inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.beam_search import BeamSearch, BeamSearchOutput, run_beam_search, step_params
from pagedllm.chat_template import apply_chat_template
from pagedllm.config.args import EngineArgs
from pagedllm.engine.input_processor import PromptType, TokensPrompt
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.utility import EngineSleepingError
from pagedllm.llm_pooling import PoolingMixin
from pagedllm.lora.request import LoRARequest, lora_per_prompt
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM(PoolingMixin):
    """An engine for offline batched generation, and embeddings / scores with a pooling model.

    ``model`` is a local HF directory, a .gguf file, a Hub id, or None for the embedded
    SmolLM2-135M-Instruct; every other keyword is an `EngineArgs` option (``max_model_len``,
    ``enable_prefix_caching``, ``max_num_batched_tokens``, ``dtype``, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is not None:
            engine_args["model"] = model
        self._init_engine(LLMEngine.from_engine_args(EngineArgs(**engine_args)))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM from already-parsed options (the CLI commands build EngineArgs from their flags)."""
        llm = cls.__new__(cls)
        llm._init_engine(LLMEngine.from_engine_args(engine_args))
        return llm

    def _init_engine(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation defaults (what a call without sampling_params uses)."""
        return self.llm_engine.input_processor.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # ----------------------------------------------- operations: sleep mode, weight updates, profiling
    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1; the weights stay in host memory) or the KV cache and the
        weights (level 2; reloaded from the checkpoint on wake-up). Needs `enable_sleep_mode` and no
        request in flight; until `wake_up()` generation raises EngineSleepingError."""
        self.llm_engine.call_utility("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` released: everything, or the parts in `tags` ("weights", "kv_cache")."""
        self.llm_engine.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self.llm_engine.call_utility("is_sleeping"))

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call a worker method by name (or `method(worker, *args, **kwargs)`) on every worker; the
        results in rank order."""
        return list(self.llm_engine.call_utility("collective_rpc", method, args, kwargs, timeout))

    def start_profile(self) -> None:
        """Start the torch profiler (needs `profiler_config` with profiler="torch")."""
        self.llm_engine.call_utility("start_profile")

    def stop_profile(self) -> list[str]:
        """Stop the profiler; returns the Chrome trace files written (one per worker)."""
        return list(self.llm_engine.call_utility("stop_profile"))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join an RL trainer's weight transfer group: `master_address`, `master_port`, `world_size`
        (2), `rank_offset` (1), optionally `timeout_s`. Blocks until the trainer joins too."""
        self.llm_engine.call_utility("init_weight_transfer_engine", init_info)

    def update_weights(self, update_info: dict[str, Any]) -> int:
        """Receive the weights the trainer sends (`names`, `dtype_names`, `shapes`, in send order); a
        wrong name or shape refuses the whole update. Resets the prefix cache; returns the count."""
        return int(self.llm_engine.call_utility("update_weights", update_info))

    def update_weights_from_disk(self, path: str) -> int:
        """Load the safetensors checkpoint at `path` (same architecture) into the running engine."""
        return int(self.llm_engine.call_utility("update_weights_from_disk", str(path)))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; a prompt is a string or ``{"prompt_token_ids": [...]}``.

        ``sampling_params`` is one SamplingParams for all prompts, one per prompt, or None for the
        model's defaults; ``lora_request`` likewise one adapter for all prompts or one per prompt
        (None: the base model)."""
        prompt_list: list[PromptType] = (
            [prompts] if isinstance(prompts, str | Mapping) else list(prompts)  # type: ignore[list-item]
        )
        if self.llm_engine.model_config.enable_sleep_mode and self.is_sleeping():
            raise EngineSleepingError()
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        loras = lora_per_prompt(lora_request, len(prompt_list))
        outputs = self._run_requests(prompt_list, params_list, use_tqdm, priority, loras)
        return outputs  # type: ignore[return-value]

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the beam_width best sequences (prompt tokens included, text
        decoded from them), best first. ``concurrency_limit`` searches that many prompts at a time."""
        tokenizer = self.get_tokenizer()
        processor = self.llm_engine.input_processor
        loras = lora_per_prompt(lora_request, len(prompts))
        searches = [
            BeamSearch(
                processor.tokenize_prompt(prompt)[0],
                params,
                None if params.ignore_eos else processor.eos_token_id,
                processor.max_model_len,
                None if loras is None else loras[i],
            )
            for i, prompt in enumerate(prompts)
        ]
        sampling = step_params(params)

        def generate(token_ids: list[list[int]], adapters: list[Any]) -> list[RequestOutput]:
            beams = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
            return self.generate(beams, sampling, use_tqdm=False, lora_request=adapters)

        limit = concurrency_limit or len(searches) or 1
        for start in tqdm(range(0, len(searches), limit), desc="Beam search", disable=not use_tqdm):
            run_beam_search(searches[start : start + limit], generate)
        outputs = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

    def _run_requests(
        self,
        prompts: Sequence[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput | PoolingRequestOutput]:
        """Queue every prompt with its params, step the engine until all finished, outputs in order."""
        request_ids: list[str] = []
        try:
            for i, (prompt, request_params) in enumerate(zip(prompts, params)):
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(
                    request_id,
                    prompt,
                    request_params,
                    priority=0 if priority is None else priority[i],
                    lora_request=None if loras is None else loras[i],
                )
                request_ids.append(request_id)
        except BaseException:
            # A bad prompt in the middle of the list: drop the ones already queued, then report it.
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to a list of conversations."""
        conversations: list[Sequence[Mapping[str, Any]]]
        if messages and not isinstance(messages[0], Mapping) and isinstance(messages[0], Sequence):
            conversations = list(messages)  # type: ignore[arg-type]
        else:
            conversations = [messages]  # type: ignore[list-item]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = apply_chat_template(
                tokenizer,
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            # The template wrote the special tokens itself: do not let the tokenizer add a second BOS.
            token_ids = list(tokenizer.encode(text, add_special_tokens=False))
            prompts.append(TokensPrompt(prompt_token_ids=token_ids, prompt=text))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check a LoRA adapter now (requests naming it load it on first use anyway)."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            given: list[SamplingParams] = [self.get_default_sampling_params()] * num_prompts
        elif isinstance(sampling_params, SamplingParams):
            given = [sampling_params] * num_prompts
        else:
            given = list(sampling_params)
            if len(given) != num_prompts:
                raise ValueError(
                    f"got {len(given)} sampling_params for {num_prompts} prompts: pass one or one per prompt"
                )
        # Offline callers want finished outputs only; a copy per distinct object keeps the user's untouched.
        final: dict[int, SamplingParams] = {}
        for params in given:
            if id(params) not in final:
                copy = params.clone()
                copy.output_kind = RequestOutputKind.FINAL_ONLY
                final[id(params)] = copy
        return [final[id(params)] for params in given]

    def _run_engine(
        self, request_ids: list[str], use_tqdm: bool
    ) -> list[RequestOutput | PoolingRequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        input_tokens = output_tokens = 0
        try:
            while pending:
                for output in self.llm_engine.step():
                    if not output.finished or output.request_id not in pending:
                        continue
                    pending.discard(output.request_id)
                    finished[output.request_id] = output
                    input_tokens += len(output.prompt_token_ids or ())
                    if isinstance(output, RequestOutput):
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = bar.format_dict.get("elapsed") or 0.0
                    if elapsed > 0:
                        bar.set_postfix_str(
                            f"input: {input_tokens / elapsed:.1f} toks/s, output: {output_tokens / elapsed:.1f} toks/s",
                            refresh=False,
                        )
                    bar.update(1)
        except BaseException:
            # An interrupted call must not leave its requests running in the engine.
            self.llm_engine.abort_request(sorted(pending))
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in request_ids]
