"""The step's sampling: after the forward (`ModelRunner.execute_model`) has computed the logits of the
requests that sample, it samples them under the grammar bitmask, verifies drafts, lets the drafter
observe the step, computes prompt logprobs and records the new tokens in the runner's input batch (the
scheduler never sends generated tokens back).

Composed into `ModelRunner` (pagedllm/worker/model_runner.py); the only host syncs are the ones that
read the sampled ids (and logprobs, when asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedllm.core.runner_output import LogprobsLists, ModelRunnerOutput
from pagedllm.core.sched_output import GrammarOutput
from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.layers.sampler import Sampler
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.row_tokens import RowTokens
from pagedllm.sample.watermark import Watermarker
from pagedllm.spec_decode.runner import SpecDecodeRunner, logits_row_req_ids
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.worker.batch_invariant import numerics
from pagedllm.worker.distributed_sampling import sample_on_output_rank
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_prep import StepInputs
from pagedllm.worker.prompt_logprobs import PromptLogprobs


@dataclass
class ExecuteState:
    """What `execute_model` leaves for `sample_tokens`: the step's inputs, hidden states and logits."""

    inputs: StepInputs
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


class SamplingStep:
    """Samples a step's logits into the runner's requests (its input batch and seeded generators)."""

    def __init__(
        self,
        input_batch: InputBatch,
        generators: dict[str, torch.Generator],
        sampler: Sampler,
        watermarker: Watermarker | None,
        prompt_logprobs: PromptLogprobs,
        spec: SpecDecodeRunner | None,
        vocab_size: int,
        device: torch.device,
        batch_invariant: bool,
        tokens_from_scheduler: bool,
    ) -> None:
        self.input_batch = input_batch
        # The runner's seeded generators (it creates and drops them with the requests).
        self.generators = generators
        self.sampler = sampler
        self.watermarker = watermarker
        self.prompt_logprobs = prompt_logprobs
        self.spec = spec
        self.vocab_size = vocab_size
        self.device = device
        self.batch_invariant = batch_invariant
        # Several batches in flight (pipeline parallelism): only the output rank learns the sampled
        # tokens at once; every rank takes them from the scheduler output of the request's next step.
        self.tokens_from_scheduler = tokens_from_scheduler

    def sample(
        self, state: ExecuteState, grammar_output: GrammarOutput | None, model: nn.Module
    ) -> ModelRunnerOutput:
        """Requests verifying drafts emit their accepted drafts and one token of the target's
        (`spec_decode/runner.py`). ``grammar_output`` (None when no request is constrained) masks the
        tokens each constrained request's grammar forbids."""
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
                broadcast=not self.tokens_from_scheduler,
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
        prompt_logprobs: dict[str, LogprobsLists | None] = {}
        if self.prompt_logprobs and get_pp_group().is_last_rank:
            with numerics(self.batch_invariant):
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
        )

    def _verify(
        self, state: ExecuteState, grammar_output: GrammarOutput | None
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
        inputs: StepInputs,
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
