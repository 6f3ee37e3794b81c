"""`pagedllm bench embed` end to end on a tiny random BERT with sentence-transformers beside it: the
report's counts and the agreement of the two sides' vectors (timings live in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_pooling_models import make_tiny_bert  # noqa: E402

from pagedllm.benchmarks.embed import random_sentences  # noqa: E402


def test_random_sentences_are_seeded() -> None:
    assert random_sentences(5, seed=1) == random_sentences(5, seed=1) != random_sentences(5, seed=2)
    assert all(6 <= len(s.split()) <= 30 for s in random_sentences(50, seed=0))


def test_bench_embed_with_sentence_transformers(tmp_path: Path) -> None:
    make_tiny_bert(tmp_path / "bert", pooling="mean", normalize=True)
    out = tmp_path / "embed.json"
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "bench",
        "embed",
        "--model",
        str(tmp_path / "bert"),
    ]
    cmd += ["--num-prompts", "12", "--baseline", "sentence-transformers", "--output-json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 12 and report["num_prompt_tokens"] > 12 * 6
    assert report["min_cosine_vs_sentence_transformers"] > 0.9999
    assert report["baseline"]["embeddings_per_s"] > 0 and report["ratio_vs_sentence_transformers"] > 0
    assert "embeddings/s" in result.stdout
