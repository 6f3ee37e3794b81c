"""The model runner: turns one `SchedulerOutput` into sampled tokens.

Each step it (1) applies the scheduler's delta to the persistent `InputBatch` (new requests once,
progress and new blocks for known ones, drops finished/preempted ones), (2) builds the flattened
inputs of every scheduled token (`worker/input_prep.py`), (3) runs ONE forward for the whole mixed
batch, (4) computes logits only for the last scheduled token of each request whose sequence is
complete after this step (a mid-prefill chunk samples nothing), and for the draft tokens of requests
verifying drafts (`cu_num_logits` counts the rows per request) - steps 1-4 are `execute_model` - then
`sample_tokens` (5) samples (`worker/sampling_step.py`). A pooling model pools each computed prompt
instead of steps 4-5 (`worker/pooling.py`). Sizing, allocating and binding the KV cache and warming up
the forward are the start-up's (`worker/runner_startup.py`), composed once the model is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention import AttentionGraphKey, fp8_kv
from pagedllm.config.compilation import CompilationMode, CUDAGraphMode
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.distributed.kv_transfer import KVConnectorBase
from pagedllm.distributed.parallel_state import get_pp_group, max_concurrent_batches
from pagedllm.forward_context import set_forward_context
from pagedllm.kv_cache_interface import KVCacheSpec
from pagedllm.layers.graph_key import GraphKeyContributor
from pagedllm.layers.quant import QuantGraphKey
from pagedllm.layers.sampler import Sampler
from pagedllm.lora.manager import LoRAManager
from pagedllm.metrics.tracing import step_span
from pagedllm.models import drafters, get_model
from pagedllm.models.interfaces import NativeDecoder
from pagedllm.platforms import current_platform
from pagedllm.sample.metadata import make_generator
from pagedllm.sample.watermark import Watermarker
from pagedllm.spec_decode.proposer import DrafterLoaders
from pagedllm.spec_decode.runner import SpecDecodeRunner, logits_rows, write_draft_tokens
from pagedllm.worker.batch_invariant import numerics
from pagedllm.worker.compiled_forward import CompiledForward
from pagedllm.worker.forward_paths import ForwardPaths, invariant_body
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_prep import InputPreparer
from pagedllm.worker.kv_cache import resolve_cache_dtype
from pagedllm.worker.limits import RunnerLimits
from pagedllm.worker.pipeline import PipelineStageForward
from pagedllm.worker.pooling import PoolingRunner
from pagedllm.worker.prompt_logprobs import PromptLogprobs
from pagedllm.worker.runner_startup import RunnerStartup
from pagedllm.worker.sampling_step import ExecuteState, SamplingStep

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.worker")

class ModelRunner:
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        mc = engine_config.model_config
        self.model_config = mc
        self.device: torch.device = torch.device(engine_config.device_config.device)
        self.dtype: torch.dtype = mc.dtype
        cache = engine_config.cache_config
        self.kv_cache_dtype = resolve_cache_dtype(cache.cache_dtype, mc.dtype)
        self.limits = limits = RunnerLimits.of(engine_config)
        # The step's token budget (the scheduler's, `SchedulerConfig.step_token_budget`).
        self.max_num_tokens = limits.max_num_tokens
        self.input_batch = InputBatch(
            limits.max_num_reqs, limits.max_model_len, limits.max_num_blocks_per_req
        )
        # Kept across preemption (dropped only when the request finishes): a resumed seeded request
        # continues its random stream, and prompt logprobs are not sent twice.
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_logprobs = PromptLogprobs(self.device)
        loaders = DrafterLoaders(draft_model=drafters.load_draft_model, eagle_head=drafters.load_eagle_head)
        self.spec = (
            None
            if engine_config.speculative_config is None
            else SpecDecodeRunner(engine_config, limits.max_num_reqs, limits.max_model_len, loaders)
        )
        self.model: nn.Module | None = None
        # Set for a pooling model: it pools each finished prompt instead of sampling.
        self.pooling: PoolingRunner | None = None
        # The adapters and each batch row's slot, when LoRA is enabled.
        self.lora: LoRAManager | None = None
        self._forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # At O0, the model's native body where it runs every step (see `load_model`).
        self._eager_native: NativeDecoder | None = None
        # The way each step's forward runs (native-c, compiled, eager), chosen per step class.
        self.forward_paths: ForwardPaths | None = None
        # Whether the forward returns `(hidden, aux)` for an EAGLE-3 head (`load_model` decides).
        self._aux_outputs = False
        # Batch-invariant execution runs the eager model with row-padded products (see batch_invariant).
        self.batch_invariant: bool = bool(envs.PAGEDLLM_BATCH_INVARIANT)
        # Sizing, allocation and warm-up of the KV cache and forward; composed by `load_model`.
        self._startup: RunnerStartup | None = None
        pin = current_platform.is_pin_memory_available() and self.device.type != "cpu"
        kv_scales = cache.calculate_kv_scales and fp8_kv.is_fp8(self.kv_cache_dtype)
        self.inputs = InputPreparer(limits, self.device, pin, calculate_kv_scales=kv_scales)
        wm = engine_config.watermark_config
        self.sampling = SamplingStep(
            self.input_batch, self.generators, Sampler(logprobs_mode=mc.logprobs_mode),
            Watermarker(wm) if wm is not None else None, self.prompt_logprobs, self.spec, mc.get_vocab_size(),
            self.device, self.batch_invariant,
            # Several batches in flight (pipeline parallelism): see `SamplingStep`.
            tokens_from_scheduler=max_concurrent_batches(engine_config.parallel_config) > 1,
        )
        # The step between execute_model and sample_tokens.
        self.execute_state: ExecuteState | None = None
        # collect_detailed_traces "model": a span per forward (on CUDA it times the launch, not the kernels).
        self._forward_span = step_span(engine_config.observability_config, "model", "model_forward")

    # ------------------------------------------------------------------------------- setup
    def load_model(self) -> None:
        self.model = get_model(self.engine_config)
        if self.spec is not None:
            self.spec.load_model(self.model)
        # (Before the forward is built: a compiled forward must output the auxiliary states too.)
        self._aux_outputs = self.spec is not None and self.spec.reads_aux_hidden_states()
        lora_config = self.engine_config.lora_config
        if lora_config is not None:  # wraps the projections before any forward is built around them
            self.lora = LoRAManager(
                self.model, lora_config, self.max_num_tokens, self.limits.max_num_reqs, self.dtype
            )
        if self.model_config.pooler_config is not None:
            self.pooling = PoolingRunner(self.model, self.model_config.pooler_config)
        # A pooling model runs eagerly: its steps are whole prompts, which the compiled shape classes
        # (built around decodes) do not serve.
        eager = self.batch_invariant or self.pooling is not None
        self._forward = self.model if eager else self._build_forward(self.model)
        if get_pp_group().world_size > 1:
            # Stages run eagerly: the compiled shape classes and native decode cover whole models.
            self._forward = PipelineStageForward(self.model, self.model_config.get_hidden_size(), self.dtype)
        compiled = self._forward if isinstance(self._forward, CompiledForward) else None
        # O0 compiles nothing, and neither does a native body that runs every step: it serves O0's
        # steps too, so -O0 / enforce_eager keep bfloat16 batch invariance (README: Reproducibility).
        serves_o0 = self._forward is self.model and not eager
        self._eager_native = invariant_body(self.model) if serves_o0 else None
        self.forward_paths = ForwardPaths(
            self._forward, self._step_native, compiled.describe_step if compiled is not None else None
        )
        self._startup = RunnerStartup(
            self.engine_config, self.kv_cache_dtype, self.model, self._forward, self._run_forward,
            self.native_body, self.pooling, self.spec, self.lora,
        )
        logger.info(
            "loaded %s (%.1f MiB of weights)", self.model_config.architecture, self.weights_bytes() / 2**20
        )

    def _build_forward(self, model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The callable `(input_ids, positions) -> hidden_states` each step runs: the eager module at
        O0 (`CompilationMode.NONE`), else the forward compiled per `compilation_config`."""
        cc = self.engine_config.compilation_config
        if cc.cudagraph_mode not in (None, CUDAGraphMode.NONE):
            logger.warning(
                "cudagraph_mode=%s: CUDA graph capture is not implemented yet; the forward runs without "
                "graphs (pass -cc.cudagraph_mode=NONE to silence this)",
                cc.cudagraph_mode.name,
            )
        if cc.mode in (None, CompilationMode.NONE):
            return model
        # Every feature that changes what a traced block computes (pagedllm.layers.graph_key).
        contributors: list[GraphKeyContributor] = [AttentionGraphKey(), QuantGraphKey()]
        contributors += [f for f in (self.lora, self.spec) if f is not None]
        return CompiledForward(model, self.engine_config, contributors)

    def require_lora(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True, or --enable-lora)")
        return self.lora

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("ModelRunner.load_model() must be called first")
        return self.model

    def _run_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final hidden states, and the auxiliary ones an EAGLE-3 head reads (empty without one)."""
        if self.forward_paths is None:
            raise RuntimeError("ModelRunner.load_model() must be called first")
        out = self.forward_paths(input_ids, positions)
        return out if self._aux_outputs else (out, [])  # type: ignore[return-value]

    def native_body(self) -> NativeDecoder | None:
        """The model's native body this runner's steps may run: the compiled forward's (tests drop it
        there), else the one O0 keeps for batch invariance."""
        return self._forward.native if isinstance(self._forward, CompiledForward) else self._eager_native

    def _step_native(self) -> NativeDecoder | None:
        native = self.native_body()
        if native is None or isinstance(self._forward, CompiledForward):
            return native
        # At O0 only while it runs every step (not once a LoRA adapter is loaded, or where the bound
        # cache's layout leaves it decode rows only): the module runs the rest.
        return native if native.runs_every_step(bound=True) else None

    def release_native_bindings(self) -> None:
        """Drop what a native forward keeps of the weights and caches (sleep mode frees them)."""
        native = self.native_body()
        if native is not None:
            native.release()

    # ------------------------------------------------------------------------------- start-up
    @property
    def startup(self) -> RunnerStartup:
        if self._startup is None:
            raise RuntimeError("ModelRunner.load_model() must be called first")
        return self._startup

    def weights_bytes(self) -> int:
        return self.startup.weights_bytes()

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.startup.get_kv_cache_spec()

    def determine_available_kv_cache_bytes(self) -> int:
        return self.startup.determine_available_kv_cache_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.startup.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.startup.compile_or_warm_up_model()

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return [] if self._startup is None else self._startup.kv_caches

    @property
    def num_blocks(self) -> int:
        return self.startup.num_blocks

    @property
    def kv_connector(self) -> KVConnectorBase | None:
        return None if self._startup is None else self._startup.kv_connector

    # ------------------------------------------------------------------------------- stepping
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            if self.spec is not None:
                self.spec.forget(batch, req_id)
            self._remove_row(batch.remove_request(req_id))
            self.generators.pop(req_id, None)
            self.prompt_logprobs.forget(req_id)
            if self.pooling is not None:
                self.pooling.forget(req_id)
        for req_id in so.preempted_req_ids:
            self._remove_row(batch.remove_request(req_id))
            if self.spec is not None:
                self.spec.preempted(req_id)
        for new in so.scheduled_new_reqs:
            row = batch.add_request(new)
            if self.lora is not None:
                self.lora.add_request(row, new.lora_request)
            if self.pooling is not None:
                self.pooling.add_request(new, batch)
            params = new.sampling_params
            if params.seed is not None and not params.is_greedy and new.req_id not in self.generators:
                self.generators[new.req_id] = make_generator(params.seed, self.device)
            if params.prompt_logprobs is not None:
                self.prompt_logprobs.track(new.req_id, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.req_id_to_row[req_id]
            batch.num_computed_tokens[row] = num_computed
            batch.append_blocks(row, new_blocks)
        for req_id, num_computed, token_ids in zip(cached.req_ids, cached.num_computed_tokens, cached.token_ids):
            batch.write_scheduled_tokens(batch.req_id_to_row[req_id], num_computed, token_ids)

    def _remove_row(self, row: int | None) -> None:
        if self.lora is not None and row is not None:
            self.lora.remove_request(row)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        """Run the step's forward and the logits of its sampling requests; `sample_tokens` finishes it."""
        self._update_states(so)
        self.execute_state = None
        connector = self.kv_connector if so.kv_connector_metadata is not None else None
        if connector is not None:
            # The copies run in the background while the inputs are prepared.
            connector.start_load_kv(so.kv_connector_metadata)
        if so.total_num_scheduled_tokens == 0:
            return
        model = self._require_model()
        drafts = so.scheduled_spec_decode_tokens
        if drafts:
            write_draft_tokens(self.input_batch, drafts)
        inputs = self.inputs.prepare(so, self.input_batch, self.lora, self.startup.metadata_builder())
        if connector is not None:
            connector.wait_for_load()
        with numerics(self.batch_invariant), set_forward_context(inputs.attn_metadata), self._forward_span(None):
            hidden, aux_hidden = self._run_forward(inputs.input_ids, inputs.positions)
        if connector is not None:
            connector.save_kv(so.kv_connector_metadata)
        if self.pooling is not None:
            computed = self.input_batch.num_computed_tokens[inputs.rows]
            pooled = self.pooling.pool(hidden, inputs.req_ids, inputs.query_start_loc, computed)
            self.execute_state = ExecuteState(inputs, hidden, None, self.inputs.arange[:1].copy(), pooled)
            return
        logits = None
        cu_num_logits = logits_rows(
            self.inputs.logits_indices.np, self.inputs.arange, inputs.sample_idx, inputs.query_start_loc,
            inputs.req_ids, drafts,
        )
        num_rows = int(cu_num_logits[-1])
        if num_rows and get_pp_group().is_last_rank:  # only the last pipeline stage has an LM head
            with numerics(self.batch_invariant):
                rows = hidden.index_select(0, self.inputs.logits_indices.to_device(num_rows))
                logits = model.compute_logits(rows)
        self.execute_state = ExecuteState(inputs, hidden, logits, cu_num_logits, drafts=drafts, aux_hidden=aux_hidden)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step `execute_model` ran (`SamplingStep.sample`)."""
        state, self.execute_state = self.execute_state, None
        if state is None:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        output = self.sampling.sample(state, grammar_output, self._require_model())
        output.kv_connector_stats = self._finish_kv_saves()
        return output

    def _finish_kv_saves(self) -> dict[str, float]:
        """Wait for the connector's writes (a request's blocks are stored before its output leaves)."""
        connector = self.kv_connector
        if connector is None:
            return {}
        connector.wait_for_save()
        return connector.take_stats()

    def propose_draft_token_ids(self) -> dict[str, list[int]] | None:
        """The drafter's proposals for the next step (req_id -> draft tokens); None without a
        speculative method."""
        return None if self.spec is None else self.spec.propose(self.input_batch, self.generators)
