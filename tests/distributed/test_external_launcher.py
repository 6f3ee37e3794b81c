"""`external_launcher`: torchrun starts two ranks, each running its own engine with TP=2; both
produce the tokens of one rank, and the output rank its logits too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parallel import _assert_same, _one_rank  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import make_tiny_model  # noqa: E402


@pytest.mark.slow
def test_torchrun_tp2_matches_one_rank(tmp_path: Path) -> None:
    model_dir = tmp_path / "qwen2"
    make_tiny_model("qwen2-bias", model_dir)
    want = _one_rank(model_dir)
    out = tmp_path / "out"
    script = Path(__file__).resolve().parent / "torchrun_rank.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(script), str(model_dir), str(out)],
        check=True, timeout=300, env=env,
    )
    rank0, rank1 = (
        [
            (tokens, [{int(t): v for t, v in step.items()} for step in logits])  # JSON keys are strings
            for tokens, logits in json.loads(Path(f"{out}.{r}.json").read_text())
        ]
        for r in (0, 1)
    )
    _assert_same(rank0, want)
    assert [tokens for tokens, _ in rank1] == [tokens for tokens, _ in want]
