"""Records what a model-based drafter (draft model, EAGLE head) of an offline `LLM` proposes, with the
sequence each proposal continued, for tests that recompute the drafts from scratch."""

from __future__ import annotations

from typing import Any

from pagedllm import LLM


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """A list that fills with `(the request's tokens, its drafts)` for every proposal from now on."""
    drafter = llm.llm_engine.engine_core.core.model_executor.driver_worker.runner.spec.proposer
    proposals: list[tuple[list[int], list[int]]] = []
    original = drafter.propose

    def propose(batch: Any, requests: list[Any]) -> dict[str, list[int]]:
        drafts = original(batch, requests)
        for r in requests:
            if drafts.get(r.req_id):
                n = int(batch.num_tokens[r.row])
                proposals.append((batch.token_ids[r.row, :n].tolist(), drafts[r.req_id]))
        return drafts

    drafter.propose = propose
    return proposals
