"""The model runner: turns one `SchedulerOutput` into sampled tokens.

Each step it (1) applies the scheduler's delta to the persistent `InputBatch` (new requests once,
progress and new blocks for known ones, drops finished/preempted ones), (2) builds the flattened
inputs of every scheduled token with vectorized numpy ops into preallocated buffers (positions,
token ids, slot mapping, query_start_loc, seq_lens, block tables), (3) runs ONE forward for the whole
mixed batch, (4) computes logits only for the last scheduled token of each request whose sequence is
complete after this step (a mid-prefill chunk samples nothing), and for the draft tokens of requests
verifying drafts (`cu_num_logits` counts the rows per request) - steps 1-4 are `execute_model` - then
`sample_tokens` (5) samples, under the grammar bitmask once structured outputs exist, computes prompt
logprobs, and records the new tokens in its own state (the scheduler never sends generated tokens back).
A pooling model pools each computed prompt instead of steps 4-5 (`worker/pooling.py`).

The only host syncs per step are the ones that read the sampled ids (and logprobs, when asked).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention import (
    AttentionGraphKey,
    AttentionMetadata,
    CommonAttentionMetadata,
    fp8_kv,
)
from pagedllm.config.compilation import CompilationMode, CUDAGraphMode
from pagedllm.core.runner_output import LogprobsLists, ModelRunnerOutput
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.distributed.kv_transfer import KVConnectorBase
from pagedllm.distributed.parallel_state import get_pp_group, max_concurrent_batches
from pagedllm.forward_context import set_forward_context
from pagedllm.layers.graph_key import GraphKeyContributor
from pagedllm.layers.quant import QuantGraphKey
from pagedllm.layers.sampler import Sampler
from pagedllm.lora.manager import LoRAManager
from pagedllm.metrics.tracing import step_span
from pagedllm.models import drafters, get_model
from pagedllm.models.interfaces import NativeDecoder
from pagedllm.platforms import current_platform
from pagedllm.sample.metadata import build_sampling_metadata, make_generator
from pagedllm.sample.row_tokens import RowTokens
from pagedllm.sample.watermark import Watermarker
from pagedllm.spec_decode.proposer import DrafterLoaders
from pagedllm.spec_decode.runner import SpecDecodeRunner, logits_row_req_ids, logits_rows, write_draft_tokens
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.worker.batch_invariant import BatchInvariantMode
from pagedllm.worker.compiled_forward import CompiledForward
from pagedllm.worker.distributed_sampling import sample_on_output_rank
from pagedllm.worker.forward_paths import ForwardPaths, invariant_body
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_cache import (
    resolve_cache_dtype,
)
from pagedllm.worker.pipeline import PipelineStageForward
from pagedllm.worker.pooling import PoolingRunner
from pagedllm.worker.prompt_logprobs import PromptLogprobs
from pagedllm.worker.runner_startup import RunnerStartup
from pagedllm.worker.staged_buffer import StagedBuffer

logger = logging.getLogger("pagedllm.worker")

@dataclass
class _StepInputs:
    attn_metadata: AttentionMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_ids: list[str]
    rows: np.ndarray  # InputBatch row of each batch request, in batch order
    query_start_loc: np.ndarray  # [num_reqs + 1] host copy
    # Batch indices of the requests that sample a token this step.
    sample_idx: np.ndarray


@dataclass
class _ExecuteState:
    """What `execute_model` leaves for `sample_tokens`: the step's inputs, hidden states and logits."""

    inputs: _StepInputs
    hidden: torch.Tensor
    # [cu_num_logits[-1], vocab] float32: for each sampling request (in sample_idx order), the logits of
    # its last token followed by those of its draft tokens.
    logits: torch.Tensor | None
    # [len(sample_idx) + 1] cumulative logits rows per sampling request (0 first): 1 per request, 1 + k
    # for a request verifying k drafts.
    cu_num_logits: np.ndarray
    # A pooling model's outputs of the step (req_id -> pooled vector).
    pooled: dict[str, list[float]] | None = None
    # The drafts the step verifies (req_id -> draft tokens).
    drafts: dict[str, list[int]] | None = None
    # The streams entering the target layers an EAGLE-3 head reads (empty without one).
    aux_hidden: list[torch.Tensor] = field(default_factory=list)


class ModelRunner(RunnerStartup):
    def __init__(self, engine_config: Any) -> None:
        self.engine_config = engine_config
        mc = engine_config.model_config
        self.model_config = mc
        self.cache_config = engine_config.cache_config
        self.device: torch.device = torch.device(engine_config.device_config.device)
        self.dtype: torch.dtype = mc.dtype
        self.kv_cache_dtype = resolve_cache_dtype(self.cache_config.cache_dtype, mc.dtype)
        # Whether the next step with tokens sets the layers' fp8 scales (`calculate_kv_scales`).
        self.kv_scales_pending = self.cache_config.calculate_kv_scales and fp8_kv.is_fp8(self.kv_cache_dtype)
        self.block_size: int = self.cache_config.block_size
        self.max_model_len: int = mc.max_model_len
        sc = engine_config.scheduler_config
        self.max_num_reqs: int = sc.max_num_seqs
        self.max_num_tokens: int = sc.step_token_budget
        self.vocab_size: int = mc.get_vocab_size()
        self.max_num_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req)
        self.sampler = Sampler(logprobs_mode=mc.logprobs_mode)
        wm = engine_config.watermark_config
        self.watermarker = Watermarker(wm) if wm is not None else None
        # Kept across preemption (dropped only when the request finishes): a resumed seeded request
        # continues its random stream, and prompt logprobs are not sent twice.
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_logprobs = PromptLogprobs(self.device)
        spec = engine_config.speculative_config
        self.spec = (
            None
            if spec is None
            else SpecDecodeRunner(
                engine_config,
                self.max_num_reqs,
                self.max_model_len,
                DrafterLoaders(draft_model=drafters.load_draft_model, eagle_head=drafters.load_eagle_head),
            )
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
        self.kv_caches: list[torch.Tensor] = []
        # The KV connector's worker side (see distributed/kv_transfer), created with the cache.
        self.kv_connector: KVConnectorBase | None = None

        pin = current_platform.is_pin_memory_available() and self.device.type != "cpu"
        t, r = self.max_num_tokens, self.max_num_reqs
        self._input_ids = StagedBuffer(t, torch.int64, self.device, pin)
        self._positions = StagedBuffer(t, torch.int64, self.device, pin)
        self._slot_mapping = StagedBuffer(t, torch.int64, self.device, pin)
        self._query_start_loc = StagedBuffer(r + 1, torch.int32, self.device, pin)
        self._seq_lens = StagedBuffer(r, torch.int32, self.device, pin)
        self._num_computed = StagedBuffer(r, torch.int32, self.device, pin)
        self._block_tables = StagedBuffer((r, self.max_num_blocks_per_req), torch.int32, self.device, pin)
        # One logits row per scheduled token at most (every token of a request verifying drafts).
        self._logits_indices = StagedBuffer(t, torch.int64, self.device, pin)
        # Reused index scratch of the flattened batch.
        self._arange = np.arange(max(t, r + 1), dtype=np.int64)
        # Marks the end of a step's host->device input copies: the pinned host buffers are rewritten
        # next step only after it (a step that samples nothing has no other sync point).
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        # Several batches in flight (pipeline parallelism): only the output rank learns the sampled
        # tokens at once; every rank takes them from the scheduler output of the request's next step.
        self._tokens_from_scheduler = max_concurrent_batches(engine_config.parallel_config) > 1
        # The step between execute_model and sample_tokens.
        self.execute_state: _ExecuteState | None = None
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
                self.model, lora_config, self.max_num_tokens, self.max_num_reqs, self.dtype
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

    def _prepare_inputs(self, so: SchedulerOutput) -> _StepInputs:
        batch = self.input_batch
        total = so.total_num_scheduled_tokens
        if total > self.max_num_tokens:
            raise ValueError(f"{total} tokens scheduled, more than the step budget of {self.max_num_tokens}")
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        # Decodes first: the attention backend takes its no-gather fast path when the decode rows are
        # exactly the first rows of the batch.
        is_prefill = num_sched > 1
        # Reorder only when some prefill precedes a decode (the scheduler often sends them sorted).
        if np.any(is_prefill[:-1] & ~is_prefill[1:]):
            order = np.argsort(is_prefill, kind="stable")
            rows, num_sched = rows[order], num_sched[order]
            req_ids = [req_ids[i] for i in order.tolist()]
        num_reqs = len(req_ids)
        if self.lora is not None:
            self.lora.set_step(rows, num_sched)

        cu = np.cumsum(num_sched)
        qsl = self._query_start_loc.np[: num_reqs + 1]
        qsl[0] = 0
        qsl[1:] = cu
        computed = batch.num_computed_tokens[rows]
        seq_lens = computed + num_sched

        # Per token: its request's row and its position (computed tokens + offset in this step's run).
        tok_req = np.repeat(rows, num_sched)
        positions = self._positions.np[:total]
        np.subtract(self._arange[:total], np.repeat(cu - num_sched - computed, num_sched), out=positions)
        width = batch.token_ids.shape[1]
        np.take(batch.token_ids.reshape(-1), tok_req * width + positions, out=self._input_ids.np[:total])
        block_idx = tok_req * self.max_num_blocks_per_req + positions // self.block_size
        block_ids = np.take(batch.block_table.reshape(-1), block_idx)
        np.add(block_ids * self.block_size, positions % self.block_size, out=self._slot_mapping.np[:total])

        self._seq_lens.np[:num_reqs] = seq_lens
        self._num_computed.np[:num_reqs] = computed
        np.take(batch.block_table, rows, axis=0, out=self._block_tables.np[:num_reqs])

        # A request samples when its whole sequence is in the cache after this step; otherwise it is
        # mid-prefill (its next chunk comes later).
        sample_idx = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        common = CommonAttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            query_start_loc=self._query_start_loc.to_device(num_reqs + 1),
            seq_lens=self._seq_lens.to_device(num_reqs),
            num_computed_tokens=self._num_computed.to_device(num_reqs),
            block_tables=self._block_tables.to_device(num_reqs)[:, :max_blocks],
            slot_mapping=self._slot_mapping.to_device(total),
            max_query_len=int(num_sched.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            calculate_kv_scales=self.kv_scales_pending,
        )
        self.kv_scales_pending = False
        md = self.attn_metadata_builder.build(common)
        input_ids = self._input_ids.to_device(total)
        positions_dev = self._positions.to_device(total)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return _StepInputs(
            attn_metadata=md,
            input_ids=input_ids,
            positions=positions_dev,
            req_ids=req_ids,
            rows=rows,
            query_start_loc=qsl.copy(),
            sample_idx=sample_idx,
        )

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
        inputs = self._prepare_inputs(so)
        if connector is not None:
            connector.wait_for_load()
        with self._numerics(), set_forward_context(inputs.attn_metadata), self._forward_span(None):
            hidden, aux_hidden = self._run_forward(inputs.input_ids, inputs.positions)
        if connector is not None:
            connector.save_kv(so.kv_connector_metadata)
        if self.pooling is not None:
            computed = self.input_batch.num_computed_tokens[inputs.rows]
            pooled = self.pooling.pool(hidden, inputs.req_ids, inputs.query_start_loc, computed)
            self.execute_state = _ExecuteState(inputs, hidden, None, self._arange[:1].copy(), pooled)
            return
        logits = None
        cu_num_logits = logits_rows(
            self._logits_indices.np, self._arange, inputs.sample_idx, inputs.query_start_loc, inputs.req_ids, drafts
        )
        num_rows = int(cu_num_logits[-1])
        if num_rows and get_pp_group().is_last_rank:  # only the last pipeline stage has an LM head
            with self._numerics():
                rows = hidden.index_select(0, self._logits_indices.to_device(num_rows))
                logits = model.compute_logits(rows)
        self.execute_state = _ExecuteState(inputs, hidden, logits, cu_num_logits, drafts=drafts, aux_hidden=aux_hidden)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step `execute_model` ran; requests verifying drafts emit their accepted drafts
        and one token of the target's (`spec_decode/runner.py`). ``grammar_output`` (None when no request
        is constrained) masks the tokens each constrained request's grammar forbids."""
        state, self.execute_state = self.execute_state, None
        if state is None:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        inputs = state.inputs
        num_reqs = len(inputs.req_ids)
        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: list[LogprobsLists | None] = [None] * num_reqs
        if state.logits is not None and state.drafts:
            tokens, token_lps = self._verify(state, grammar_output)
            for j, i in enumerate(inputs.sample_idx.tolist()):
                sampled_token_ids[i] = tokens[j]
                logprobs[i] = token_lps[j]
        # Under pipeline parallelism the other stages have no logits but still learn the tokens.
        elif state.logits is not None or (state.pooled is None and inputs.sample_idx.size):
            result = sample_on_output_rank(
                lambda: self._sample(state.logits, inputs, grammar_output),
                inputs.sample_idx.size,
                broadcast=not self._tokens_from_scheduler,
            )
            if result is not None:
                sampled, sampled_lps = result
                self.input_batch.append_sampled_tokens(inputs.rows[inputs.sample_idx], np.asarray(sampled))
                for j, i in enumerate(inputs.sample_idx.tolist()):
                    sampled_token_ids[i] = [sampled[j]]
                    logprobs[i] = sampled_lps[j]
        if self.spec is not None:
            self.spec.end_step(
                inputs.req_ids, inputs.rows, inputs.query_start_loc, inputs.sample_idx, state.hidden, state.aux_hidden,
                self.input_batch,
            )
        model = self._require_model()
        prompt_logprobs: dict[str, LogprobsLists | None] = {}
        if self.prompt_logprobs and get_pp_group().is_last_rank:
            with self._numerics():
                prompt_logprobs = self.prompt_logprobs.compute(
                    model, state.hidden, self.input_batch, inputs.req_ids, inputs.rows, inputs.query_start_loc
                )
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            req_id_to_index={r: i for i, r in enumerate(inputs.req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            pooler_output=state.pooled or {},
            kv_connector_stats=self._finish_kv_saves(),
        )

    def _finish_kv_saves(self) -> dict[str, float]:
        """Wait for the connector's writes (a request's blocks are stored before its output leaves)."""
        if self.kv_connector is None:
            return {}
        self.kv_connector.wait_for_save()
        return self.kv_connector.take_stats()

    def _numerics(self) -> contextlib.AbstractContextManager[object]:
        return BatchInvariantMode() if self.batch_invariant else contextlib.nullcontext()

    def propose_draft_token_ids(self) -> dict[str, list[int]] | None:
        """The drafter's proposals for the next step (req_id -> draft tokens); None without a
        speculative method."""
        return None if self.spec is None else self.spec.propose(self.input_batch, self.generators)

    def _verify(
        self, state: _ExecuteState, grammar_output: GrammarOutput | None
    ) -> tuple[list[list[int]], list[LogprobsLists | None]]:
        assert self.spec is not None and state.logits is not None and state.drafts is not None
        inputs = state.inputs
        req_ids = [inputs.req_ids[i] for i in inputs.sample_idx.tolist()]
        if grammar_output is not None:
            # Constrained requests draft nothing (the scheduler drops their drafts): one row each.
            apply_grammar_bitmask(state.logits, grammar_output, logits_row_req_ids(req_ids, state.cu_num_logits))
        return self.spec.sample(
            self.sampler,
            state.logits,
            state.cu_num_logits,
            req_ids,
            inputs.rows[inputs.sample_idx],
            state.drafts,
            self.input_batch,
            self.generators,
            self.vocab_size,
        )

    def _sample(
        self,
        logits: torch.Tensor,
        inputs: _StepInputs,
        grammar_output: GrammarOutput | None,
    ) -> tuple[list[int], list[LogprobsLists | None]]:
        batch = self.input_batch
        n = inputs.sample_idx.size
        if grammar_output is not None:
            apply_grammar_bitmask(
                logits, grammar_output, [inputs.req_ids[i] for i in inputs.sample_idx.tolist()]
            )
        rows = inputs.rows[inputs.sample_idx].tolist()
        generators = {
            j: self.generators[batch.req_ids[row]]  # type: ignore[index]
            for j, row in enumerate(rows)
            if batch.req_ids[row] in self.generators
        }
        params = [batch.sampling_params[row] for row in rows]
        metadata = build_sampling_metadata(
            params,  # type: ignore[arg-type]
            RowTokens(batch, rows, output=False),
            RowTokens(batch, rows, output=True),
            generators,
            self.vocab_size,
            self.device,
        )
        if self.watermarker is not None:
            metadata.watermark = self.watermarker.batch(batch, rows, params, logits.shape[1], self.device)
        out = self.sampler(logits, metadata)
        sampled: list[int] = out.sampled_token_ids.tolist()
        if out.logprobs is None:
            return sampled, [None] * n
        return sampled, out.logprobs.to_request_lists(metadata.num_logprobs)
