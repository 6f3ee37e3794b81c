"""The model runner's side of speculative decoding: drafts in, verified tokens out, next drafts.

Each step the scheduler sends the drafts it scheduled (`scheduled_spec_decode_tokens`); they are
written after each request's last token (`write_draft_tokens`), the one forward scores every drafted
position (the attention backend runs a request's 1 + k tokens as decode rows), `logits_rows` picks
the 1 + k logits rows of each verifying request, and `SpecDecodeRunner.sample` builds the sampling
inputs of every row as if the drafts before it had been accepted (penalties, bad words and min_tokens
see them in the output), verifies with the rejection sampler and records the emitted tokens. After
the step, `propose` drafts the next tokens of the requests that sampled. The proposer is whichever
`Proposer` the configured method names; the runner reads only what the protocol declares.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.core.runner_output import LogprobsLists
from pagedllm.layers.sampler import Sampler
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.rejection_sampler import verify
from pagedllm.sample.row_tokens import RowTokens
from pagedllm.spec_decode.draft_control import DraftControl, DraftLength
from pagedllm.spec_decode.proposer import DraftBatch, DrafterLoaders, DraftRequest, TargetStep
from pagedllm.spec_decode.proposers import make_proposer


def write_draft_tokens(batch: DraftBatch, drafts: dict[str, list[int]]) -> None:
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


def logits_row_req_ids(req_ids: list[str], cu_num_logits: np.ndarray) -> list[str]:
    """The request of each logits row (``req_ids``: the sampling requests, in logits order)."""
    counts = np.diff(cu_num_logits)
    return [req_ids[i] for i in np.repeat(np.arange(len(req_ids)), counts).tolist()]


class _DraftRowTokens(RowTokens):
    """Output tokens seen by each logits row: the request's output, then the drafts before the row."""

    def __init__(self, batch: DraftBatch, rows: np.ndarray, starts: np.ndarray, offsets: np.ndarray,
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
    def __init__(self, engine_config: EngineConfig, max_num_reqs: int, max_model_len: int, loaders: DrafterLoaders) -> None:
        spec_config = engine_config.speculative_config
        self.proposer = make_proposer(engine_config, loaders)
        self.draft_length = DraftLength(spec_config, max_num_reqs)
        self.method: str = spec_config.rejection_sample_method
        self.max_model_len = max_model_len
        # The requests that sampled in the last step: the ones to draft for.
        self.sampled_req_ids: list[str] = []
        # Per request: how many drafts pay for their verification, from its acceptance history
        # (token drafters are also asked while a request drafts nothing: shadow drafts keep it up).
        self.control = DraftControl(shadows=self.proposer.shadow_drafts)

    def load_model(self, target: nn.Module) -> None:
        self.proposer.load_model(target)

    def reads_aux_hidden_states(self) -> bool:
        """Whether the target's forward returns `(hidden, aux)` for an EAGLE-3 head (set at load)."""
        return bool(self.proposer.aux_hidden_layers)

    # Speculative decoding's part of a compiled block's key (a GraphKeyContributor,
    # pagedllm.layers.graph_key). It puts nothing on the target's blocks (verification rows are decode
    # rows of a larger shape class); what it changes of the target's traced forward is which layers'
    # input streams the model's layer loop returns (EAGLE-3), the same for every block.
    def owns(self, obj: object) -> bool:
        return False

    def graph_key(self, block: nn.Module) -> Hashable:
        return tuple(self.proposer.aux_hidden_layers)

    def step_graph_key(self) -> Hashable:
        return None

    def end_step(
        self, req_ids: list[str], rows: np.ndarray, query_start_loc: np.ndarray, sample_idx: np.ndarray,
        hidden: torch.Tensor, aux_hidden: list[torch.Tensor], batch: DraftBatch,
    ) -> None:
        """The step's sampling requests are the next ones to draft for; the proposer sees the hidden
        states of every token the target computed (the auxiliary ones side by side, when it asked)."""
        self.sampled_req_ids = [req_ids[i] for i in sample_idx.tolist()]
        features = torch.cat(aux_hidden, dim=-1) if aux_hidden else hidden
        self.proposer.observe(
            TargetStep(req_ids, rows, query_start_loc, batch.num_computed_tokens[rows].copy(), features)
        )

    def kv_cache_share(self, target_bytes_per_block: int, kv_cache_dtype: torch.dtype) -> float:
        """The target's share of the KV cache budget (a draft model's cache has as many blocks)."""
        spec = self.proposer.kv_cache_spec(kv_cache_dtype)
        if spec is None:
            return 1.0
        return target_bytes_per_block / (target_bytes_per_block + spec.bytes_per_block)

    def initialize_kv_cache(self, num_blocks: int, kv_cache_dtype: torch.dtype) -> None:
        self.proposer.initialize_kv_cache(num_blocks, kv_cache_dtype)

    def release_kv_cache(self) -> int:
        """Free a model drafter's cache (sleep mode); returns its bytes."""
        return self.proposer.release_kv_cache()

    def preempted(self, req_id: str) -> None:
        """A preempted request resumes in other blocks: what the proposer keeps of it is stale."""
        self.proposer.forget(req_id, None)

    def forget(self, batch: DraftBatch, req_id: str) -> None:
        """A finished request: its output may feed the drafter (suffix decoding's global trie)."""
        self.control.forget(req_id)
        row = batch.req_id_to_row.get(req_id)
        self.proposer.forget(req_id, None if row is None else batch.output_token_ids(row).copy())

    def propose(self, batch: DraftBatch, generators: dict[str, torch.Generator]) -> dict[str, list[int]]:
        # k = 0: switched off for this batch size. The proposer is still called (with no requests): an
        # EAGLE head must read this step's hidden states; suffix tries catch up when drafting resumes.
        k = self.draft_length(len(self.sampled_req_ids))
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
            # A request that verifies nothing this step drafts a shadow of the full k, which its next
            # tokens score (see pagedllm.spec_decode.draft_control).
            requests.append(DraftRequest(req_id, row, k_req or k, k_req, temperature, generators.get(req_id)))
        proposed = self.proposer.propose(batch, requests)
        drafts: dict[str, list[int]] = {}
        for r in requests:
            tokens = proposed.get(r.req_id, [])
            verified = tokens[: r.num_verified]
            self.control.record(r.req_id, verified if r.num_verified else tokens, int(batch.num_tokens[r.row]))
            if verified:
                drafts[r.req_id] = verified
        return drafts

    def _draft_probs(
        self, req_ids: list[str], drafts: dict[str, list[int]], cu_num_logits: np.ndarray, probs: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The distributions a draft model drew its drafts from, by logits row (a point mass on the
        draft where it took the argmax); None when every draft was a point mass."""
        sampled = self.proposer.draft_probs
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
        batch: DraftBatch,
        generators: dict[str, torch.Generator],
        vocab_size: int,
    ) -> tuple[list[list[int]], list[LogprobsLists | None]]:
        """Verify the drafts of the sampling requests ``req_ids`` (batch ``rows``; ``logits`` already
        masked by any grammar); returns per request its emitted tokens and their logprobs."""
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
        row_req_ids = logits_row_req_ids(req_ids, cu_num_logits)
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
