"""The drafters' model loaders refuse what cannot work, naming the checkpoint (their drafting is
tested in tests/spec_decode/proposers)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_llm import make_tiny_llm

from pagedllm.errors import ModelLoadError
from pagedllm.models.drafters import _request_aux_hidden, load_eagle_head


def test_eagle_head_of_another_hidden_size_is_refused(tmp_path: Path) -> None:
    head = make_tiny_llm(tmp_path / "head")
    spec = SimpleNamespace(method="eagle", model=str(head), draft_model_config=None, target_model_config=None)
    cfg = SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(get_hidden_size=lambda: 4096))
    with pytest.raises(ModelLoadError, match=r"EAGLE head .*head has hidden size \d+, the target 4096"):
        load_eagle_head(cfg, torch.nn.Module(), torch.device("cpu"), torch.float32)


def test_eagle3_needs_a_target_that_returns_aux_hidden_states() -> None:
    with pytest.raises(ModelLoadError, match="Module cannot return the hidden states an EAGLE-3 head reads"):
        _request_aux_hidden(torch.nn.Module(), [0, 1, 2], "head")
