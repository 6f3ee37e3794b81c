"""The model runner's side of speculative decoding: drafts in, verified tokens out, next drafts.

Each step the scheduler sends the drafts it scheduled (`scheduled_spec_decode_tokens`); they are
written after each request's last token (`write_draft_tokens`), the one forward scores every drafted
position (the attention backend runs a request's 1 + k tokens as decode rows), `logits_rows` picks
the 1 + k logits rows of each verifying request, and `SpecDecodeRunner.sample` builds the sampling
inputs of every row as if the drafts before it had been accepted (penalties, bad words and min_tokens
see them in the output), verifies with the rejection sampler and records the emitted tokens. After
the step, `propose` drafts the next tokens of the requests that sampled.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.core.runner_output import LogprobsLists
from pagedllm.core.sched_output import GrammarOutput
from pagedllm.layers.sampler import Sampler
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.rejection_sampler import verify
from pagedllm.spec_decode import DraftLength, make_proposer
from pagedllm.spec_decode.draft_control import DraftControl
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.worker.draft_model import DraftModelProposer
from pagedllm.worker.eagle import EagleProposer, TargetStep
from pagedllm.worker.input_batch import InputBatch, RowTokens
from pagedllm.worker.model_drafter import DraftRequest


def write_draft_tokens(batch: InputBatch, drafts: dict[str, list[int]]) -> None:
    """Place each request's drafts after its last token, where the input gather reads them (they
    are not part of the sequence: num_tokens is unchanged)."""
    for req_id, token_ids in drafts.items():
        row = batch.req_id_to_row[req_id]
        start = int(batch.num_tokens[row])
        batch.token_ids[row, start : start + len(token_ids)] = token_ids


def logits_rows(
    out: np.ndarray,
    arange: np.ndarray,
    sample_idx: np.ndarray,
    query_start_loc: np.ndarray,
    req_ids: list[str],
    drafts: dict[str, list[int]],
) -> np.ndarray:
    """Fill ``out`` with the logits indices (token positions in the flattened batch) of the sampling
    requests ``sample_idx``: each one's last scheduled token, preceded by its draft positions when it
    verifies drafts. Returns cu_num_logits."""
    ends = query_start_loc[sample_idx + 1]
    if not drafts:
        n = sample_idx.size
        out[:n] = ends - 1
        return arange[: n + 1].copy()
    num_logits = 1 + np.fromiter(
        (len(drafts.get(req_ids[i], ())) for i in sample_idx.tolist()), dtype=np.int64, count=sample_idx.size
    )
    cu = np.zeros(sample_idx.size + 1, dtype=np.int64)
    np.cumsum(num_logits, out=cu[1:])
    total = int(cu[-1])
    # Row j of request i is the token at ends[i] - num_logits[i] + j.
    offsets = np.repeat(ends - num_logits - cu[:-1], num_logits)
    np.add(offsets, arange[:total], out=out[:total])
    return cu


class _DraftRowTokens(RowTokens):
    """Output tokens seen by each logits row: the request's output, then the drafts before the row."""

    def __init__(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, offsets: np.ndarray,
                 draft_ids: np.ndarray) -> None:
        super().__init__(batch, rows.tolist(), output=True)
        self._starts, self._offsets, self._drafts = starts, offsets, draft_ids

    def _tokens(self, i: int) -> np.ndarray:
        start = int(self._starts[i])
        drafted = self._drafts[start : start + int(self._offsets[i])]
        return np.concatenate([super()._tokens(i), drafted])


def _merge_logprobs(per_row: list[LogprobsLists | None], start: int, n: int) -> LogprobsLists | None:
    rows = per_row[start : start + n]
    if rows[0] is None:
        return None
    return LogprobsLists(
        token_ids=[r.token_ids[0] for r in rows],  # type: ignore[union-attr]
        logprobs=[r.logprobs[0] for r in rows],  # type: ignore[union-attr]
        sampled_token_ranks=[r.sampled_token_ranks[0] for r in rows],  # type: ignore[union-attr]
    )


class SpecDecodeRunner:
    def __init__(self, engine_config: Any, max_num_reqs: int, max_model_len: int) -> None:
        spec_config = engine_config.speculative_config
        # A draft model or EAGLE head drafts for the whole batch at once; the token-based drafters
        # per request.
        self.model_drafter: DraftModelProposer | EagleProposer | None = None
        if spec_config.uses_draft_model():
            self.model_drafter = DraftModelProposer(engine_config)
        elif spec_config.method in ("eagle", "eagle3"):
            self.model_drafter = EagleProposer(engine_config)
        self.proposer = None if self.model_drafter is not None else make_proposer(spec_config)
        self.draft_length = DraftLength(spec_config, max_num_reqs)
        self.method: str = spec_config.rejection_sample_method
        self.max_model_len = max_model_len
        # The requests that sampled in the last step: the ones to draft for.
        self.sampled_req_ids: list[str] = []
        # Per request: how many drafts pay for their verification, from its acceptance history
        # (token drafters are also asked while a request drafts nothing: shadow drafts keep it up).
        self.control = DraftControl(shadows=self.proposer is not None)

    def load_model(self, target: nn.Module) -> None:
        if isinstance(self.model_drafter, EagleProposer):
            self.model_drafter.load_model(target)
        elif self.model_drafter is not None:
            self.model_drafter.load_model()

    def reads_aux_hidden_states(self) -> bool:
        """Whether the target's forward returns `(hidden, aux)` for an EAGLE-3 head (set at load)."""
        return isinstance(self.model_drafter, EagleProposer) and bool(self.model_drafter.aux_layers)

    def end_step(
        self, req_ids: list[str], rows: np.ndarray, query_start_loc: np.ndarray, sample_idx: np.ndarray,
        hidden: torch.Tensor, aux_hidden: list[torch.Tensor], batch: InputBatch,
    ) -> None:
        """The step's sampling requests are the next ones to draft for; an EAGLE head reads the hidden
        states of every token the target computed (EAGLE-3: the auxiliary ones, side by side)."""
        self.sampled_req_ids = [req_ids[i] for i in sample_idx.tolist()]
        if isinstance(self.model_drafter, EagleProposer):
            features = torch.cat(aux_hidden, dim=-1) if aux_hidden else hidden
            self.model_drafter.observe(
                TargetStep(req_ids, rows, query_start_loc, batch.num_computed_tokens[rows].copy(), features)
            )

    def kv_cache_share(self, target_bytes_per_block: int, kv_cache_dtype: torch.dtype) -> float:
        """The target's share of the KV cache budget (a draft model's cache has as many blocks)."""
        if self.model_drafter is None:
            return 1.0
        draft = self.model_drafter.kv_cache_spec(kv_cache_dtype).bytes_per_block
        return target_bytes_per_block / (target_bytes_per_block + draft)

    def initialize_kv_cache(self, num_blocks: int, kv_cache_dtype: torch.dtype) -> None:
        if self.model_drafter is not None:
            self.model_drafter.initialize_kv_cache(num_blocks, kv_cache_dtype)

    def release_kv_cache(self) -> int:
        """Free a model drafter's cache (sleep mode); returns its bytes."""
        return 0 if self.model_drafter is None else self.model_drafter.release_kv_cache()

    def preempted(self, req_id: str) -> None:
        """A preempted request resumes in other blocks: a draft model's cache of it is gone (an EAGLE
        head keeps nothing per request: the target recomputes it and the head follows)."""
        if self.model_drafter is not None:
            self.model_drafter.forget(req_id)

    def forget(self, batch: InputBatch, req_id: str) -> None:
        """A finished request: its output may feed the drafter (suffix decoding's global trie)."""
        self.control.forget(req_id)
        if self.model_drafter is not None:
            self.model_drafter.forget(req_id)
            return
        assert self.proposer is not None
        row = batch.req_id_to_row.get(req_id)
        self.proposer.forget(req_id, None if row is None else batch.output_token_ids(row).copy())

    def propose(self, batch: InputBatch, generators: dict[str, torch.Generator]) -> dict[str, list[int]]:
        k = self.draft_length(len(self.sampled_req_ids))
        if k == 0 and not isinstance(self.model_drafter, EagleProposer):
            # Switched off for this batch size (suffix tries catch up on the tokens when drafting resumes;
            # an EAGLE head must still read this step's hidden states).
            return {}
        requests: list[DraftRequest] = []
        for req_id in self.sampled_req_ids if k > 0 else ():
            row = batch.req_id_to_row.get(req_id)
            if row is None:
                continue
            n = int(batch.num_tokens[row])
            params = batch.sampling_params[row]
            room = self.max_model_len - n
            if params is not None and params.max_tokens is not None:
                # Accepted drafts plus the target's own token must fit in max_tokens.
                room = min(room, params.max_tokens - (n - int(batch.num_prompt_tokens[row])) - 1)
            k_req = min(self.control.length(req_id, batch.token_ids[row, :n], k), room)
            if k_req <= 0 and not (room > 0 and self.control.wants_shadow(req_id)):
                continue
            temperature = 0.0 if params is None else params.temperature
            requests.append(DraftRequest(req_id, row, k_req, temperature, generators.get(req_id)))
        if self.model_drafter is not None:
            drafts = self.model_drafter.propose(batch, requests)
            for r in requests:
                self.control.record(r.req_id, drafts.get(r.req_id, []), int(batch.num_tokens[r.row]))
        else:
            assert self.proposer is not None
            drafts = {}
            for r in requests:
                n = int(batch.num_tokens[r.row])
                # A request that verifies nothing this step drafts a shadow of the full k, which its
                # next tokens score (see pagedllm.spec_decode.draft_control).
                proposed = self.proposer.propose(r.req_id, batch.token_ids[r.row, :n], r.num_drafts or k)
                self.control.record(r.req_id, proposed[: r.num_drafts] if r.num_drafts else proposed, n)
                drafts[r.req_id] = proposed[: r.num_drafts]
        return {req_id: tokens for req_id, tokens in drafts.items() if tokens}

    def _draft_probs(
        self, req_ids: list[str], drafts: dict[str, list[int]], cu_num_logits: np.ndarray, probs: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The distributions a draft model drew its drafts from, by logits row (a point mass on the
        draft where it took the argmax); None when every draft was a point mass."""
        sampled = {} if self.model_drafter is None else self.model_drafter.draft_probs
        if probs is None or not any(r in sampled for r in req_ids):
            return None
        q = torch.zeros_like(probs)
        for i, req_id in enumerate(req_ids):
            d = drafts.get(req_id)
            if not d:
                continue
            start = int(cu_num_logits[i])
            if req_id in sampled:
                q[start : start + len(d)] = sampled[req_id][: len(d)].to(q.device)
            else:
                rows = torch.arange(start, start + len(d), device=q.device)
                q[rows, torch.tensor(d, device=q.device)] = 1.0
        return q

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        cu_num_logits: np.ndarray,
        req_ids: list[str],
        rows: np.ndarray,
        drafts: dict[str, list[int]],
        batch: InputBatch,
        generators: dict[str, torch.Generator],
        grammar_output: GrammarOutput | None,
        vocab_size: int,
    ) -> tuple[list[list[int]], list[LogprobsLists | None]]:
        """Verify the drafts of the sampling requests ``req_ids`` (batch ``rows``); returns per request
        its emitted tokens and their logprobs."""
        counts = np.diff(cu_num_logits)
        total = int(cu_num_logits[-1])
        starts = np.repeat(cu_num_logits[:-1], counts)
        offsets = np.arange(total) - starts
        row_of = np.repeat(rows, counts)
        draft_ids = np.full(total, -1, dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            d = drafts.get(req_id)
            if d:
                draft_ids[cu_num_logits[i] : cu_num_logits[i] + len(d)] = d
        row_req_ids = [req_ids[i] for i in np.repeat(np.arange(len(req_ids)), counts).tolist()]
        if grammar_output is not None:
            # Constrained requests draft nothing (the scheduler drops their drafts): one row each.
            apply_grammar_bitmask(logits, grammar_output, row_req_ids)
        row_list = row_of.tolist()
        row_gens = {j: generators[r] for j, r in enumerate(row_req_ids) if r in generators}
        metadata = build_sampling_metadata(
            [batch.sampling_params[r] for r in row_list],  # type: ignore[misc]
            RowTokens(batch, row_list, output=False),
            _DraftRowTokens(batch, row_of, starts, offsets, draft_ids),
            row_gens,
            vocab_size,
            logits.device,
        )
        raw = sampler.raw_logprobs(logits, metadata)
        processed = sampler.process_logits(logits, metadata)
        greedy_ids = None if metadata.all_random else processed.argmax(dim=-1)
        probs = None
        if not metadata.all_greedy:
            processed = sampler.truncate(processed, metadata)
            probs = processed.softmax(dim=-1)
        verified = verify(
            greedy_ids,
            probs,
            metadata.greedy_mask,
            draft_ids,
            cu_num_logits,
            row_gens,
            self.method,
            self._draft_probs(req_ids, drafts, cu_num_logits, probs),
        )
        lps = sampler.gather_logprobs(raw, processed, metadata, verified.row_token_ids.to(logits.device))
        per_row = lps.to_request_lists(metadata.num_logprobs) if lps is not None else [None] * total
        logprobs = [
            _merge_logprobs(per_row, int(cu_num_logits[i]), len(tokens))
            for i, tokens in enumerate(verified.token_ids)
        ]
        for row, tokens in zip(rows.tolist(), verified.token_ids):
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(tokens)] = tokens
            batch.num_tokens[row] = n + len(tokens)
        return verified.token_ids, logprobs
