"""Watermarked generation end to end: an LLM with `watermark_config` samples 200-token outputs that the
detector recognizes under the key and not under another key; per-request opt-outs and greedy requests
are left alone. Every request is seeded, so the outcome is deterministic; the statistics below say
how unlikely a failure of a correct implementation was over that one fixed draw."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.watermark import detect

KEY, OTHER_KEY = 1234, 4321
NUM_TOKENS = 200
NUM_EACH = 4


@pytest.fixture(scope="module")
def flat_tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Small initial weights: nearly uniform next-token distributions over the 384 tokens (high entropy,
    # the regime where a watermark is detectable; a peaked model leaves it nothing to choose).
    return make_tiny_llm(tmp_path_factory.mktemp("wm") / "m", initializer_range=0.02)


# One engine per algorithm, 200 decode steps each: the two variants beyond the first run with the slow tests.
@pytest.mark.parametrize(
    "algorithm",
    [
        "gumbel",
        pytest.param("dual_key_gumbel", marks=pytest.mark.slow),
        pytest.param("kgw", marks=pytest.mark.slow),
    ],
)
def test_watermark_is_detected_with_the_key_only(flat_tiny_llm: Path, tmp_path: Path, algorithm: str) -> None:
    llm = LLM(
        model=str(flat_tiny_llm),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        watermark_config={"algorithm": algorithm, "key": KEY},
    )
    prompts = [{"prompt_token_ids": [5 + i, 17, 42]} for i in range(2 * NUM_EACH + 1)]

    def sampled(seed: int, watermarking: bool | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True, seed=seed, watermarking=watermarking
        )

    params = [
        *(sampled(i) for i in range(NUM_EACH)),  # the engine default: watermarked
        *(sampled(i, watermarking=False) for i in range(NUM_EACH)),  # opted out
        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1),
    ]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]  # type: ignore[arg-type]
    marked, opted_out, greedy = outputs[:NUM_EACH], outputs[NUM_EACH:-1], outputs[-1]
    assert all(len(o.token_ids) == NUM_TOKENS for o in outputs)

    for out in marked:
        assert detect(out.token_ids, KEY, algorithm).p_value < 1e-3
    # Null cases: another key on watermarked text, the key on unwatermarked text. Their p-values are
    # U(0, 1) (or larger, kgw), so at least 3 of these 8 below 0.05 has probability
    # P(Binomial(8, 0.05) >= 3) < 0.006.
    null_p = [detect(o.token_ids, OTHER_KEY, algorithm).p_value for o in marked]
    null_p += [detect(o.token_ids, KEY, algorithm).p_value for o in opted_out]
    assert sum(p <= 0.05 for p in null_p) <= 2, null_p

    # Greedy requests are not watermarked: every token is the model's own argmax (rank 1 among the raw
    # logprobs), which kgw's bias or a keyed draw would break within a few tokens.
    assert greedy.logprobs is not None
    assert all(step[token].rank == 1 for step, token in zip(greedy.logprobs, greedy.token_ids))

    if algorithm == "gumbel":
        # The text path: re-tokenized text (mostly the same tokens) through the CLI, printed as JSON.
        # Through a file: random tokens may decode to control characters, a NUL among them.
        text = marked[0].text
        assert detect(text, KEY, algorithm, model=str(flat_tiny_llm)).p_value < 1e-3
        text_file = tmp_path / "text.txt"
        text_file.write_text(text, encoding="utf-8")
        cli = [sys.executable, "-m", "pagedllm.entrypoints.cli", "watermark", "detect"]
        cli += ["--model", str(flat_tiny_llm), "--key", str(KEY), "--algorithm", algorithm]
        cli += ["--file", str(text_file)]
        result = json.loads(
            subprocess.run(cli, capture_output=True, text=True, check=True, timeout=300).stdout
        )
        assert result["algorithm"] == "gumbel" and result["p_value"] < 1e-3
        assert result["num_scored_tokens"] > 100
