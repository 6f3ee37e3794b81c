"""`pagedllm bench`: the top-level help names every benchmark (it is written there without importing
the benchmarks)."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.cli import BENCHMARKS
from pagedllm.entrypoints import cli


def test_top_level_help_names_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    words = capsys.readouterr().out.split()
    listed = words[words.index("bench") + 2]
    assert words[words.index("bench") + 1] == "Benchmarks:"
    assert listed.rstrip(".").split("|") == list(BENCHMARKS)
