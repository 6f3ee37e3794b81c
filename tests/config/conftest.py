"""Fixtures for config tests: once-message caches reset per test, a tiny HF model directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaConfig

from pagedllm.config.utils import reset_once_caches


@pytest.fixture(autouse=True)
def _fresh_once_caches() -> Iterator[None]:
    reset_once_caches()
    yield
    reset_once_caches()


@pytest.fixture
def triton_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runner selection as on a machine with Triton (every CUDA build of torch ships it)."""
    monkeypatch.setattr("pagedllm.config.runner_select.triton_available", lambda: True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
    ).save_pretrained(path)
    (path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7], "do_sample": True})
    )
    return path
