"""What the token-based drafters (n-gram, suffix) share: they read only the request's tokens (and what
they keep of earlier requests), so drafting costs no forward and they keep no KV cache."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.kv_cache_interface import KVCacheSpec
from pagedllm.spec_decode.proposer import DraftBatch, DraftRequest, TargetStep


class TokenProposer:
    """The `Proposer` parts a token-based drafter does not need; it implements `draft`."""

    shadow_drafts = True

    def __init__(self) -> None:
        self.aux_hidden_layers: list[int] = []
        # Token drafters draft the argmax continuation (a point mass).
        self.draft_probs: dict[str, torch.Tensor] = {}

    def draft(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` drafts for the sequence ``token_ids`` (prompt + output so far)."""
        raise NotImplementedError

    def propose(self, batch: DraftBatch, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for r in requests:
            n = int(batch.num_tokens[r.row])
            drafts[r.req_id] = self.draft(r.req_id, batch.token_ids[r.row, :n], r.num_drafts)
        return drafts

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None:
        """Nothing is kept per request."""

    def load_model(self, target: nn.Module) -> None:
        """No model."""

    def kv_cache_spec(self, kv_cache_dtype: torch.dtype) -> KVCacheSpec | None:
        return None

    def initialize_kv_cache(self, num_blocks: int, kv_cache_dtype: torch.dtype) -> None:
        """No cache."""

    def release_kv_cache(self) -> int:
        return 0

    def observe(self, step: TargetStep) -> None:
        """The target's hidden states are not read."""
