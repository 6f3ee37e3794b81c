"""Draft-model speculative decoding (``speculative_config.method="draft_model"``): a smaller model with
the target's tokenizer proposes k tokens autoregressively, and the target verifies them in its next
forward (`worker/spec_decode.py`).

The draft's KV cache is the target's blocks in tensors of its own (`worker/model_drafter.py`), filled
lazily per request: `_DraftState.num_valid` leading positions hold the draft KV of the request's actual tokens. Each proposal first runs the positions from there to the
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

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.models import load_model
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_drafter import DraftRequest, ModelDrafter

logger = logging.getLogger("pagedllm.worker")


@dataclass
class _DraftState:
    # Leading positions whose draft KV was computed from the request's actual tokens.
    num_valid: int = 0
    # Draft tokens whose KV was written at positions num_valid, num_valid + 1, ... by the last proposal.
    written: list[int] = field(default_factory=list)


class DraftModelProposer(ModelDrafter):
    def __init__(self, engine_config: Any) -> None:
        super().__init__(engine_config)
        self.states: dict[str, _DraftState] = {}

    def load_model(self) -> None:
        # Imported here: pagedllm.config imports the worker's siblings through the model registry.
        from pagedllm.config import ModelConfig

        cfg = self.engine_config
        spec, target = cfg.speculative_config, cfg.model_config
        draft_config = ModelConfig(model=spec.model, dtype=self.dtype, seed=target.seed, skip_tokenizer_init=True)
        spec.draft_model_config = draft_config
        spec.target_model_config = target
        if draft_config.get_vocab_size() != self.vocab_size:
            logger.warning(
                "draft model vocabulary %d != target's %d: drafts use the first %d ids (same tokenizer?)",
                draft_config.get_vocab_size(),
                self.vocab_size,
                min(self.vocab_size, draft_config.get_vocab_size()),
            )
        self.model = load_model(
            draft_config.hf_config,
            draft_config.model_path,
            gguf_file=draft_config.gguf_file,
            load_format=cfg.load_config.load_format,
            dtype=self.dtype,
            device=self.device,
            seed=target.seed,
            max_positions=target.max_model_len,
        )
        logger.info("loaded draft model %s (%s)", spec.model, draft_config.architecture)

    def reset(self) -> None:
        self.states.clear()

    def forget(self, req_id: str) -> None:
        super().forget(req_id)
        self.states.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, list[int]]:
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

    def _resume_position(self, batch: InputBatch, request: DraftRequest) -> int:
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
