"""Draft-model speculative decoding (``speculative_config.method="draft_model"``): a smaller model with
the target's tokenizer proposes k tokens autoregressively, and the target verifies them in its next
forward (`spec_decode/runner.py`).

The draft's KV cache is the target's blocks in tensors of its own (`proposers/model_drafter.py`), filled
lazily per request: `_DraftState.num_valid` leading positions hold the draft KV of the request's
actual tokens. Each proposal first runs the positions from there to the
request's last token (the prompt the first time; after a verification, the accepted tokens and the
target's own token) in one forward, whose last row gives the first draft, then one single-token
forward per further draft. The KV written for a draft token stays valid exactly when the target
accepted it (the request's token at that position is the same and so is everything before it), so
the next proposal resumes after the longest accepted run. A new (or preempted and resumed) request
starts from position 0: blocks it shares through the prefix cache get the draft KV written again
(the same values), since the target may have filled them while the draft never ran over them.

The drafter runs the unpadded batch of the requests that draft (`disable_padded_drafter_batch`
changes nothing here: there are no CUDA graphs to pad for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.spec_decode.proposer import DraftBatch, DraftRequest
from pagedllm.spec_decode.proposers.model_drafter import ModelDrafter


@dataclass
class _DraftState:
    # Leading positions whose draft KV was computed from the request's actual tokens.
    num_valid: int = 0
    # Draft tokens whose KV was written at positions num_valid, num_valid + 1, ... by the last proposal.
    written: list[int] = field(default_factory=list)


class DraftModelProposer(ModelDrafter):
    def __init__(
        self, engine_config: EngineConfig, load: Callable[[EngineConfig, torch.device, torch.dtype], nn.Module]
    ) -> None:
        super().__init__(engine_config)
        self.states: dict[str, _DraftState] = {}
        self._load = load

    def load_model(self, target: nn.Module) -> None:
        self.model = self._load(self.engine_config, self.device, self.dtype)

    def reset(self) -> None:
        self.states.clear()

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None:
        super().forget(req_id, output_token_ids)
        self.states.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, requests: list[DraftRequest]) -> dict[str, list[int]]:
        requests = [r for r in requests if r.num_drafts > 0]
        drafts: dict[str, list[int]] = {r.req_id: [] for r in requests}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in requests}
        if not requests:
            self.record_probs(probs)
            return drafts
        model = self.require_model()
        # Round 0 runs each request from its first invalid position through its last token.
        starts = np.asarray([self._resume_position(batch, r) for r in requests], dtype=np.int64)
        ends = batch.num_tokens[[r.row for r in requests]]
        active = requests
        for depth in range(max(r.num_drafts for r in requests)):
            rows = np.asarray([r.row for r in active], dtype=np.int64)
            hidden = self.run(batch, rows, starts, ends)
            last = torch.from_numpy(np.cumsum(ends - starts) - 1).to(hidden.device)
            keep = self.draft_round(
                batch, model.compute_logits(hidden.index_select(0, last)), active, depth, drafts, probs
            )
            active = [active[i] for i in keep]
            # The next round runs each new draft (it sits at the position after the last one run).
            starts = ends[keep]
            ends = starts + 1
        for request in requests:
            # Every draft but the last went through the model: its KV sits at n, n + 1, ...
            self.states[request.req_id] = _DraftState(int(batch.num_tokens[request.row]), drafts[request.req_id][:-1])
        self.record_probs(probs)
        return drafts

    def _resume_position(self, batch: DraftBatch, request: DraftRequest) -> int:
        """The first position whose draft KV is missing or stale (at most the last token's)."""
        n = int(batch.num_tokens[request.row])
        state = self.states.get(request.req_id)
        if state is None:
            return 0
        valid = state.num_valid
        actual = batch.token_ids[request.row, valid : min(n, valid + len(state.written))].tolist()
        for mine, theirs in zip(state.written, actual):
            if mine != theirs:
                break
            valid += 1
        return min(valid, n - 1)
