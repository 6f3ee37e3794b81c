"""`pagedllm watermark detect` argument handling (its output on a real watermarked text is checked in
tests/engine/test_watermark_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.entrypoints import cli


def test_detect_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.txt"
    argv = ["watermark", "detect", "--model", str(tmp_path), "--key", "1", "--file", str(missing)]
    assert cli.main(argv) == 2
    assert "missing.txt" in capsys.readouterr().err
    # Exactly one of --text and --file; a known algorithm.
    for bad in (["--text", "a", "--file", str(missing)], ["--text", "a", "--algorithm", "aaronson"], []):
        with pytest.raises(SystemExit) as exc:
            cli.main(["watermark", "detect", "--model", str(tmp_path), "--key", "1", *bad])
        assert exc.value.code == 2
