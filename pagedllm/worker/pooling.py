"""The model runner's pooling side: per-request pooling params, and the pooled outputs of a step.

A pooling engine runs every prompt in one step (chunked prefill and prefix caching are off, see
`pagedllm.config.pooler`), so a request's whole prompt is in the step's hidden states and it is pooled
right there; its KV blocks are freed when the scheduler finishes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.core.sched_output import NewRequestData
from pagedllm.layers.pooler import Pooler, build_pooler
from pagedllm.pooling_params import TOKEN_TYPE_SHIFT, PoolingParams
from pagedllm.worker.input_batch import InputBatch


class PoolingRunner:
    def __init__(self, model: Any, pooler_config: Mapping[str, Any]) -> None:
        self.pooler: Pooler = build_pooler(model, pooler_config)
        self.params: dict[str, PoolingParams] = {}

    def add_request(self, new: NewRequestData, batch: InputBatch) -> None:
        params = new.pooling_params
        if params is None:
            raise ValueError(
                f"request {new.req_id!r} is not a pooling request, but the model is a pooling model"
            )
        self.params[new.req_id] = params
        if params.token_type_ids is not None:
            # The encoder splits them off again (pagedllm.models.bert).
            row = batch.req_id_to_row[new.req_id]
            types = np.asarray(params.token_type_ids, dtype=np.int64)
            batch.token_ids[row, : types.size] += types << TOKEN_TYPE_SHIFT

    def forget(self, req_id: str) -> None:
        self.params.pop(req_id, None)

    def pool(
        self,
        hidden: torch.Tensor,
        req_ids: Sequence[str],
        query_start_loc: np.ndarray,
        num_computed: np.ndarray,
    ) -> dict[str, list[float]]:
        """req_id -> pooled output of every request of the step (each one's whole prompt is in it)."""
        if np.any(num_computed):
            raise RuntimeError("a pooling request was split across steps; its prompt must run in one step")
        outputs = self.pooler(hidden, query_start_loc.tolist(), [self.params[r] for r in req_ids])
        return dict(zip(req_ids, outputs))
