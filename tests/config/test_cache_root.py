"""The one cache root every on-disk cache (compiled graphs, converted tokenizers) lives under."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.config.utils import cache_root
from pagedllm.tokenizer import default_cache_dir


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGEDLLM_CACHE_ROOT", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "pagedllm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagedllm"
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path / "root"))
    assert cache_root() == tmp_path / "root"
    assert default_cache_dir() == tmp_path / "root" / "tokenizers"
