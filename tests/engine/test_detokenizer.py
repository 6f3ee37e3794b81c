"""Incremental detokenization against ``tokenizer.decode`` of the whole sequence, and stop strings.

Two tokenizers: SmolLM2's byte-level BPE (from the embedded GGUF) and a SentencePiece-style BPE with
byte fallback built here with `tokenizers` (a Llama-2-like decoder: "▁" -> " ", ByteFallback, Fuse,
strip one leading space).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token_ids
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "你好，世界。今天天气很好。",
    "Emoji: 😀 🎉 🚀 and accents: café, naïve, über.",
    "def main():\n    print('hi')\n\treturn 0",
]
TEXTS = [
    "Grüße aus Köln 🚀🚀 und 你好世界",
    "  leading spaces and\nnew lines\n\n",
    "math: ∑ x² ≤ ∞, arrows → ⇒",
    "plain ascii words only",
    "日本語のテキストと한국어",
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return get_tokenizer(smollm2_gguf, cache_dir=tmp_path_factory.mktemp("tok"))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def sp_byte_fallback() -> PreTrainedTokenizerFast:
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    learned = trained.get_vocab()
    # Llama-2 layout: specials, then the 256 byte tokens, then the learned pieces.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in sorted(learned, key=learned.__getitem__):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in _merges(trained)]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _merges(tok: Tokenizer) -> list:
    import json

    return json.loads(tok.to_str())["model"]["merges"]


def _run(tokenizer, prompt: list[int], output: list[int], params: SamplingParams, chunk: int = 1):
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    streamed = ""
    stop = None
    for i in range(0, len(output), chunk):
        last = i + chunk >= len(output)
        stop = detok.update(output[i : i + chunk], finished=last)
        streamed += detok.get_next_output_text(finished=last or stop is not None, delta=True)
        if stop is not None:
            break
    return detok, streamed, stop


def _expected(tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def _check_random_streams(tokenizer, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    special = tokenizer.all_special_ids
    for trial in range(trials):
        # Prompts end on a plain word so that their text is stable whatever follows.
        prompt = tokenizer.encode(rng.choice(TEXTS) + " end", add_special_tokens=False) if trial % 3 else []
        if trial % 2:
            # Realistic: the tokens of real text, with special tokens sprinkled in.
            output = tokenizer.encode(rng.choice(TEXTS) + rng.choice(TEXTS), add_special_tokens=False)
            for _ in range(2):
                output.insert(rng.randrange(len(output) + 1), rng.choice(special))
        else:
            output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        skip = trial % 4 < 2
        params = SamplingParams(skip_special_tokens=skip)
        detok, streamed, _ = _run(tokenizer, prompt, output, params, chunk=1 + trial % 3)
        expected = _expected(tokenizer, prompt, output, skip)
        assert detok.output_text == expected, (prompt, output, skip)
        assert streamed == expected
        assert detok.output_token_ids == output


def test_random_streams_smollm2(smol: PreTrainedTokenizerFast) -> None:
    _check_random_streams(smol, trials=300, seed=0)


def test_random_streams_byte_fallback(sp_byte_fallback: PreTrainedTokenizerFast) -> None:
    tok = sp_byte_fallback
    # The CJK and emoji characters outside the learned pieces really use byte tokens.
    ids = tok.encode("Grüße 🚀", add_special_tokens=False)
    assert any(3 <= i < 259 for i in ids)
    _check_random_streams(tok, trials=300, seed=1)


def test_random_streams_metaspace_decoder(sp_byte_fallback: PreTrainedTokenizerFast) -> None:
    """The other SentencePiece decoder: Metaspace drops every "▁" of the first token of a decode."""
    backend = Tokenizer.from_str(sp_byte_fallback.backend_tokenizer.to_str())
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert tok.decode(_encode(tok, "a b")) == "a b"
    _check_random_streams(tok, trials=200, seed=2)


def test_multibyte_character_is_held_until_complete(sp_byte_fallback: PreTrainedTokenizerFast) -> None:
    rocket = [3 + b for b in "🚀".encode()]  # four byte tokens
    detok = IncrementalDetokenizer(sp_byte_fallback, [], SamplingParams())
    ids = rocket + sp_byte_fallback.encode("fox", add_special_tokens=False)
    texts = []
    for token in ids:
        detok.update([token])
        texts.append(detok.get_next_output_text(finished=False, delta=True))
    assert texts[:4] == ["", "", "", ""]
    assert "".join(texts) == "🚀 fox" == sp_byte_fallback.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_prompt_ending_in_special_tokens(sp_byte_fallback: PreTrainedTokenizerFast, skip: bool) -> None:
    tok = sp_byte_fallback
    specials = [tok.bos_token_id, tok.eos_token_id] * 4
    output = _encode(tok, "Hello world")
    for prompt in (specials, _encode(tok, "hi there") + specials):
        detok, streamed, _ = _run(tok, prompt, output, SamplingParams(skip_special_tokens=skip))
        assert detok.output_text == streamed == _expected(tok, prompt, output, skip)
        if skip and prompt is not specials:
            # The leading space of "▁Hello" after the prompt's text belongs to the output.
            assert detok.output_text == " Hello world"


def test_emoji_split_across_byte_level_tokens(smol: PreTrainedTokenizerFast) -> None:
    ids = smol.encode("a😀b你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [], SamplingParams())
    pieces = []
    for token in ids:
        detok.update([token])
        pieces.append(detok.get_next_output_text(finished=False, delta=True))
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == "a😀b你好"


def test_incomplete_character_released_when_finished(smol: PreTrainedTokenizerFast) -> None:
    ids = smol.encode("x😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [], SamplingParams())
    detok.update(ids[:-1])
    assert detok.get_next_output_text(finished=False, delta=False) == "x"
    assert detok.get_next_output_text(finished=True, delta=False) == smol.decode(ids[:-1])


def test_special_tokens_kept_or_skipped(smol: PreTrainedTokenizerFast) -> None:
    ids = smol.encode("Hi<|im_end|>there", add_special_tokens=False)
    for skip, text in ((True, "Hithere"), (False, "Hi<|im_end|>there")):
        detok, _, _ = _run(smol, [], ids, SamplingParams(skip_special_tokens=skip))
        assert detok.output_text == text


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(smol: PreTrainedTokenizerFast, include: bool) -> None:
    ids = _encode(smol, " The answer is forty-two. STOP here and more text")
    params = SamplingParams(stop=["P h", "zzz"], include_stop_str_in_output=include)
    detok, streamed, stop = _run(smol, _encode(smol, "Question:"), ids, params)
    assert stop == "P h"
    # "P h" spans the tokens "STOP" and " here".
    expected = " The answer is forty-two. STOP h" if include else " The answer is forty-two. STO"
    assert detok.output_text == streamed == expected


@pytest.mark.parametrize("tokenizer_name", ["smol", "sp_byte_fallback"])
def test_random_stop_strings(tokenizer_name: str, request: pytest.FixtureRequest) -> None:
    """A stop string drawn from the text cuts it at its first occurrence, whatever the chunking."""
    tok = request.getfixturevalue(tokenizer_name)
    rng = random.Random(3)
    for trial in range(60):
        output = _encode(tok, rng.choice(TEXTS) + " " + rng.choice(TEXTS))
        text = _expected(tok, [], output, True)
        start = rng.randrange(len(text) - 3)
        stop = text[start : start + rng.randrange(1, 4)]
        if not stop.strip("\ufffd"):
            continue
        include = trial % 2 == 1
        detok, streamed, found = _run(
            tok, [], output, SamplingParams(stop=[stop], include_stop_str_in_output=include), 1 + trial % 4
        )
        cut = text.find(stop) + (len(stop) if include else 0)
        assert found == stop and detok.output_text == streamed == text[:cut], (text, stop)


def test_earliest_stop_string_wins_and_nothing_half_sent(smol: PreTrainedTokenizerFast) -> None:
    ids = _encode(smol, "alpha beta gamma delta")
    detok = IncrementalDetokenizer(smol, [], SamplingParams(stop=["delta", "beta g"]))
    sent = []
    stop = None
    for token in ids:
        stop = detok.update([token])
        sent.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop:
            break
    assert stop == "beta g" and detok.output_text == "alpha "
    # While running, no prefix of a stop string was streamed ("beta" reached no client before the cut).
    assert "".join(sent) == "alpha "


def test_stop_string_ignored_within_min_tokens(smol: PreTrainedTokenizerFast) -> None:
    ids = _encode(smol, "stop now, then stop again")
    n_first = len(_encode(smol, "stop now,"))
    detok, _, stop = _run(smol, [], ids, SamplingParams(stop=["stop"], min_tokens=n_first, max_tokens=50))
    assert stop == "stop" and detok.output_text == "stop now, then "


def test_stop_terminated_drops_the_stop_token_text(smol: PreTrainedTokenizerFast) -> None:
    ids = _encode(smol, "Hello") + [smol.eos_token_id]
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [], params)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "Hello" and detok.output_token_ids == ids
    kept = IncrementalDetokenizer(
        smol, [], SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    )
    kept.update(ids, stop_terminated=True)
    assert kept.output_text == "Hello<|im_end|>"


def test_cumulative_output_and_no_detokenize(smol: PreTrainedTokenizerFast) -> None:
    ids = _encode(smol, "one two three")
    detok = IncrementalDetokenizer(smol, [], SamplingParams(stop=["xyz"]))
    detok.update(ids)
    # Cumulative text lags by len("xyz") - 1 characters while running.
    assert detok.get_next_output_text(finished=False, delta=False) == "one two thr"
    assert detok.get_next_output_text(finished=True, delta=False) == "one two three"
    silent = IncrementalDetokenizer(smol, [1, 2], SamplingParams(detokenize=False))
    assert silent.update(ids) is None and silent.output_text == "" and silent.output_token_ids == ids
    assert IncrementalDetokenizer(None, [], SamplingParams()).update(ids) is None


def test_decode_token_ids_for_logprobs(smol: PreTrainedTokenizerFast) -> None:
    ids = _encode(smol, "Hello world")
    assert decode_token_ids(smol, ids + [smol.eos_token_id]) == ["Hello", " world", "<|im_end|>"]
