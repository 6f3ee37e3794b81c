"""EAGLE speculative decoding (``speculative_config.method`` "eagle" and "eagle3"): a one-layer draft
head fed the target's hidden states proposes k tokens; the target verifies them in its next forward
(`spec_decode/runner.py`). An EAGLE-1 head (`models/llama_eagle.py`) reads the target's final hidden
states and drafts through the target's LM head; an EAGLE-3 head (`models/llama_eagle3.py`) reads the
residual streams entering three target layers (which the target's forward returns beside its final
hidden states once told which: `SupportsEagle3`, so a compiled forward outputs them too) and has its
own small-vocabulary LM head.

The head keeps a paged KV cache in the target's blocks (`proposers/model_drafter.py`). Its entry at
position i is computed from token i + 1 and the target's hidden state at i, which exist only in the
step where the target computed position i: so after EVERY step (drafting or not, mid-prefill chunks
included) the head runs each scheduled request's positions whose next token is now known (a prefill
chunk's all, a verification's accepted drafts plus the last token, up to the one before the
request's newest token). The last of those rows yields the first draft; each further draft runs one
position more, the head's own output standing in for the target's hidden state. Those draft
positions are run again by the target, and so by the head, in the next step.

A block shared through the prefix cache holds the head's entries of the request that computed it; the
entry at the block's last position was computed from the next token of THAT request (the block hash
does not cover it), so a request diverging right after a shared block may draft slightly worse
there - never wrongly, the target verifies every draft.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.spec_decode.proposer import DraftBatch, DraftRequest, EagleHeadLoad, TargetStep
from pagedllm.spec_decode.proposers.model_drafter import ModelDrafter


class EagleProposer(ModelDrafter):
    def __init__(
        self, engine_config: EngineConfig, load: Callable[[EngineConfig, nn.Module, torch.device, torch.dtype], EagleHeadLoad]
    ) -> None:
        super().__init__(engine_config)
        # Draft logits in the target's vocabulary from the head's output.
        self.compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.step: TargetStep | None = None
        self._load = load

    def load_model(self, target: nn.Module) -> None:
        """The head (its loader tells the target which hidden states to return for it)."""
        self.model, self.compute_logits, self.aux_hidden_layers = self._load(
            self.engine_config, target, self.device, self.dtype
        )

    def observe(self, step: TargetStep) -> None:
        self.step = step

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, requests: list[DraftRequest]) -> dict[str, list[int]]:
        step, self.step = self.step, None
        self.draft_probs = {}
        if step is None:
            return {}
        assert self.compute_logits is not None
        rows, starts, ends, hidden_rows = self._catch_up_ranges(batch, step)
        if not rows:
            return {}
        rows_np, ends_np = np.asarray(rows), np.asarray(ends)
        features = self.run(
            batch, rows_np, np.asarray(starts), ends_np, 1, step.hidden.index_select(0, hidden_rows.to(step.hidden.device))
        )
        # Each catch-up run's last row: the feature that predicts the token after the request's newest.
        last = np.cumsum(ends_np - np.asarray(starts)) - 1
        last_row = {row: int(last[i]) for i, row in enumerate(rows) if ends[i] == batch.num_tokens[row] - 1}
        active = [r for r in requests if r.num_drafts > 0 and r.row in last_row]
        drafts: dict[str, list[int]] = {r.req_id: [] for r in active}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in active}
        if not active:
            return drafts
        features = features.index_select(0, torch.tensor([last_row[r.row] for r in active], device=features.device))
        for depth in range(max(r.num_drafts for r in active)):
            keep = self.draft_round(batch, self.compute_logits(features), active, depth, drafts, probs)
            if not keep:
                break
            active = [active[i] for i in keep]
            positions = np.asarray([int(batch.num_tokens[r.row]) - 1 + depth for r in active], dtype=np.int64)
            features = self.run(
                batch,
                np.asarray([r.row for r in active], dtype=np.int64),
                positions,
                positions + 1,
                1,
                features.index_select(0, torch.tensor(keep, device=features.device)),
            )
        self.record_probs(probs)
        return drafts

    @staticmethod
    def _catch_up_ranges(
        batch: DraftBatch, step: TargetStep
    ) -> tuple[list[int], list[int], list[int], torch.Tensor]:
        """Per request of the step: its row and the positions [start, end) the head runs now (those the
        target computed whose next token is known), and the rows of the target's hidden states."""
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        hidden_rows: list[np.ndarray] = []
        for j, req_id in enumerate(step.req_ids):
            row = int(step.rows[j])
            if batch.req_id_to_row.get(req_id) != row:
                continue
            start = int(step.num_computed[j])
            end = min(start + int(step.query_start_loc[j + 1] - step.query_start_loc[j]), int(batch.num_tokens[row]) - 1)
            if end <= start:
                continue
            rows.append(row)
            starts.append(start)
            ends.append(end)
            hidden_rows.append(np.arange(end - start) + int(step.query_start_loc[j]))
        index = np.concatenate(hidden_rows) if hidden_rows else np.zeros(0, dtype=np.int64)
        return rows, starts, ends, torch.from_numpy(index)
