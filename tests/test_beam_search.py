"""Beam search: the search's bookkeeping on scripted candidates, and `LLM.beam_search` against
transformers' own beam search on a tiny random Llama (same beams, same cumulative logprobs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_llm import make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm import LLM
from pagedllm.beam_search import BeamSearch, get_beam_search_score
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import BeamSearchParams

EOS = 2


def candidates(**logprobs: float) -> dict[int, Logprob]:
    """Candidate tokens named t<id>."""
    return {int(name[1:]): Logprob(value) for name, value in logprobs.items()}


def test_beams_keep_the_best_extensions_and_retire_eos() -> None:
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=2), EOS, max_model_len=64)
    search.advance([candidates(t10=-0.1, t11=-0.5, t2=-0.2, t12=-3.0)])
    # EOS ends a beam (completed); the two best others live on.
    assert [b.tokens for b in search.beams] == [[7, 8, 10], [7, 8, 11]]
    assert [b.tokens for b in search.completed] == [[7, 8, 2]]
    search.advance([candidates(t20=-1.0, t21=-2.0), candidates(t22=-0.1, t23=-0.2)])
    assert search.done
    assert [b.tokens for b in search.beams] == [[7, 8, 11, 22], [7, 8, 11, 23]]
    best = search.best()
    # The completed EOS beam scores -0.2 over 3 tokens (its EOS does not count): the best.
    assert [b.tokens for b in best] == [[7, 8, 2], [7, 8, 11, 22]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert best[1].cum_logprob == pytest.approx(-0.6)


def test_length_penalty_and_full_context() -> None:
    assert get_beam_search_score([1, 2, 3, EOS], -3.0, EOS, length_penalty=1.0) == -1.0
    assert get_beam_search_score([1, 2, 3, 4], -4.0, EOS, length_penalty=2.0) == -0.25
    # A beam that fills the context is complete: nothing is asked for it any more.
    search = BeamSearch([1, 2, 3], BeamSearchParams(beam_width=1, max_tokens=5), EOS, max_model_len=4)
    search.advance([candidates(t9=-1.0)])
    assert search.done and [b.tokens for b in search.best()] == [[1, 2, 3, 9]]
    with pytest.raises(ValueError, match="beam_width") as info:
        BeamSearch([1], BeamSearchParams(beam_width=0, max_tokens=1), EOS, max_model_len=8)
    assert info.value.param == "beam_width"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("beam_llm"))


def _hf_beams(
    model_dir: Path, prompt: list[int], width: int, new_tokens: int
) -> list[tuple[list[int], float]]:
    """transformers' beam search (EOS disabled), each beam with its cumulative logprob re-scored by the
    model: the scores transformers reports are length-normalised by a version-dependent length."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=new_tokens,
            do_sample=False,
            early_stopping=False,
            pad_token_id=0,
        )
        beams = []
        for sequence in out:
            logits = model(sequence[None]).logits[0].float().log_softmax(-1)
            generated = sequence[len(prompt) :].tolist()
            positions = range(len(prompt) - 1, len(sequence) - 1)
            score = sum(logits[p, t].item() for p, t in zip(positions, generated))
            beams.append((generated, score))
    return beams


def test_llm_beam_search_matches_transformers(model_dir: Path) -> None:
    llm = LLM(
        model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, optimization_level=0
    )
    prompts = [[5, 60, 70, 80], [9, 100, 33]]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        expected = _hf_beams(model_dir, prompt, width=3, new_tokens=6)
        got = [(beam.tokens[len(prompt) :], beam.cum_logprob) for beam in output.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        assert [score for _, score in got] == pytest.approx([score for _, score in expected], abs=1e-3)
        # vLLM's shape: the prompt's tokens lead each beam, and the text is all of it decoded.
        assert all(beam.tokens[: len(prompt)] == prompt for beam in output.sequences)
        assert output.sequences[0].text == tokenizer.decode(output.sequences[0].tokens)
