"""`pagedllm env` prints collect_env's report (its content is checked in tests/test_collect_env.py)."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints import cli


def test_env_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pagedllm ") and "CPU ISA: AVX2 " in out and "Kernel libraries" in out
