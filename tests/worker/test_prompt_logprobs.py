"""Prompt-logprobs bookkeeping: a request resumed after preemption keeps its position."""

from __future__ import annotations

import torch

from pagedllm.worker.prompt_logprobs import PromptLogprobs


def test_tracking_survives_a_second_admission() -> None:
    tracker = PromptLogprobs(torch.device("cpu"))
    assert not tracker
    tracker.track("a", 0)
    # Preempted and admitted again with 16 tokens computed: positions from 0 are still owed.
    tracker.track("a", 16)
    assert tracker._next == {"a": 0}
    tracker.forget("a")
    tracker.forget("never-tracked")
    assert not tracker
