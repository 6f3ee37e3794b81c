"""SamplingParams: defaults, validation messages, normalisation, msgspec round trip, model defaults."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.errors import RequestError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.user_set_fields == frozenset()
    assert not p.is_greedy


VALIDATION_CASES: list[tuple[dict, str]] = [
    ({"n": 0}, "n must be at least 1, got 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than 0, got 0.0"),
    ({"temperature": -0.1}, "temperature must be non-negative, got -0.1"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_k": -2}, "top_k must be 0 or -1 (disabled), or at least 1, got -2"),
    ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1"),
    (
        {"min_tokens": 20, "max_tokens": 10},
        "min_tokens must be less than or equal to max_tokens=10, got 20",
    ),
    ({"logprobs": -2}, "logprobs must be non-negative, or -1 for the whole vocabulary, got -2"),
    ({"prompt_logprobs": -5}, "prompt_logprobs must be non-negative"),
    ({"stop": ["ok", ""]}, "stop cannot contain an empty string"),
    ({"stop": "x", "detokenize": False}, "stop strings are only supported when detokenize is True"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must contain non-negative integer token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias must map token ids to numbers"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias values must be finite"),
    ({"seed": 2**64}, "seed must fit in 64 bits"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"n": True}, "n must be an integer, got True"),
    ({"n": 2.0}, "n must be an integer, got 2.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be greater than 0, got -1.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number, got nan"),
    ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
    ({"max_tokens": 3.0}, "max_tokens must be an integer, got 3.0"),
    ({"min_tokens": "2"}, "min_tokens must be an integer, got '2'"),
    ({"logprobs": 1.5}, "logprobs must be an integer, got 1.5"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"stop": ["ok", 3]}, "stop must be a string or a list of strings, got ['ok', 3]"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of token ids, got 7"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids must contain non-negative integer token ids, got 1.0"),
    ({"allowed_token_ids": 3}, "allowed_token_ids must be a list of token ids, got 3"),
    ({"allowed_token_ids": [2, -3]}, "allowed_token_ids must contain non-negative integer token ids"),
    ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers, got [1, 2]"),
    ({"logit_bias": {-4: 1.0}}, "logit_bias must contain non-negative integer token ids, got -4"),
    ({"bad_words": "bad"}, "bad_words must be a list of strings, got 'bad'"),
    ({"bad_words": ["  "]}, "bad_words must be a list of non-blank strings"),
    (
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs needs exactly one of json, json_object, regex, choice, grammar, structural_tag; got regex, choice",
    ),
    ({"structured_outputs": {}}, "; got none"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json is not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a non-empty list"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar must be a non-empty string"),
    ({"structured_outputs": {"jsn": {}}}, "'jsn'"),
    ({"structured_outputs": "json"}, "structured_outputs must be a StructuredOutputsParams or a dict"),
    ({"output_kind": 9}, "output_kind must be one of"),
    ({"ignore_eos": "false"}, "ignore_eos must be True or False, got 'false'"),
    ({"watermarking": "yes"}, "watermarking must be True, False or None, got 'yes'"),
    ({"detokenize": 0}, "detokenize must be True or False, got 0"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be True or False, got None"),
    ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens must be True or False"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be True or False"),
    # vLLM's fields the engine does not implement: a ValueError (what vLLM raises), never a TypeError.
    ({"best_of": 3, "n": 2}, "best_of=3 is not supported: only best_of equal to n=2"),
    ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors are not supported"),
]


@pytest.mark.parametrize(("kwargs", "message"), VALIDATION_CASES)
def test_validation_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    # The error names the field at fault (the first one given in each case), for the server's `param`.
    assert info.value.param == next(iter(kwargs))


def test_neutral_values_of_unimplemented_vllm_fields_are_taken() -> None:
    assert SamplingParams(n=2, best_of=2).n == 2
    assert SamplingParams(best_of=None, logits_processors=[]).logits_processors == []


# Filled in by the front-end (update_from_generation_config / update_from_tokenizer), not by users.
_INTERNAL_FIELDS = {"all_stop_token_ids", "bad_words_token_ids", "user_set_fields"}


def test_every_user_field_has_a_validation_case() -> None:
    """A new SamplingParams field must come with a rejected value above (and the check behind it)."""
    covered = {name for kwargs, _ in VALIDATION_CASES for name in kwargs}
    fields = set(SamplingParams.__struct_fields__) - _INTERNAL_FIELDS
    # ... and every field named there must be a real one.
    assert fields - covered == set()
    assert covered - fields == set()


def test_normalisation() -> None:
    p = SamplingParams(stop="END", top_k=-1, logit_bias={"5": 2}, max_tokens=None)
    assert p.stop == ["END"] and p.top_k == 0 and p.logit_bias == {5: 2.0} and p.max_tokens is None
    # Greedy turns the truncation knobs off (they cannot change an argmax).
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.is_greedy and (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.99e-5).is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    # stop_token_ids always end the request, so min_tokens must mask them too.
    assert SamplingParams(stop_token_ids=[7, 3]).all_stop_token_ids == [3, 7]
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_verify_against_model_limits() -> None:
    SamplingParams(logprobs=20, prompt_logprobs=0).verify(max_logprobs=20, vocab_size=100)
    with pytest.raises(RequestError, match="logprobs=21 is more than the model's max_logprobs=20") as info:
        SamplingParams(logprobs=21).verify(max_logprobs=20, vocab_size=100)
    assert info.value.param == "logprobs"
    with pytest.raises(ValueError, match="prompt_logprobs=100 is more than"):
        SamplingParams(prompt_logprobs=-1).verify(max_logprobs=20, vocab_size=100)
    SamplingParams(logprobs=-1).verify(max_logprobs=-1, vocab_size=100)
    with pytest.raises(
        ValueError, match=r"allowed_token_ids contains token ids outside the vocabulary \[0, 100\): \[100\]"
    ):
        SamplingParams(allowed_token_ids=[1, 100]).verify(max_logprobs=20, vocab_size=100)
    with pytest.raises(ValueError, match="logit_bias contains token ids outside"):
        SamplingParams(logit_bias={500: 1.0}).verify(max_logprobs=20, vocab_size=100)


def test_generation_config_applies_only_to_unset_fields() -> None:
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_new_tokens": 64, "do_sample": True}
    p = SamplingParams(temperature=1.0)  # explicitly the engine default: must be kept
    p.update_from_generation_config(gen)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 0.9, 50, 64)
    q = SamplingParams(max_tokens=None, top_p=None)  # None = "not set" except for max_tokens
    q.update_from_generation_config(gen)
    assert (q.temperature, q.top_p, q.max_tokens) == (0.6, 0.9, None)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams().update_from_generation_config({"top_p": 7})


def test_generation_config_eos_ids() -> None:
    p = SamplingParams(stop_token_ids=[9])
    p.update_from_generation_config({"eos_token_id": [2, 4]}, model_eos_token_id=2)
    # The primary EOS is the request's eos_token_id; the extra one becomes a stop token id.
    assert p.stop_token_ids == [9, 4] and p.all_stop_token_ids == [2, 4, 9]
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 5}, model_eos_token_id=2)
    assert q.stop_token_ids == [] and q.all_stop_token_ids == []


def test_msgspec_round_trip_inside_engine_core_request() -> None:
    p = SamplingParams(
        temperature=0.3, stop=["a", "b"], seed=3, logit_bias={1: -2.0}, logprobs=2, max_tokens=None
    )
    p.update_from_generation_config({"top_k": 40}, model_eos_token_id=0)
    req = EngineCoreRequest("r1", [1, 2, 3], p, eos_token_id=0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert decoded.sampling_params == p
    assert decoded.sampling_params.user_set_fields == frozenset({"temperature", "max_tokens"})


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], logit_bias={1: 1.0})
    c = p.clone()
    assert c == p
    c.stop.append("y")  # type: ignore[union-attr]
    assert c.logit_bias is not p.logit_bias and p.stop == ["x"]


class _SpaceTokenizer:
    """Words are tokens; a leading space makes a different token (as in BPE vocabularies)."""

    vocab = {"bad": 1, " bad": 2, "word": 3, " word": 4, " ": 5}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = text.replace(" ", "| ").split("|")
        return [self.vocab[t] for t in pieces if t]


def test_update_from_tokenizer_bad_words() -> None:
    p = SamplingParams(bad_words=["bad", " bad word"])
    p.update_from_tokenizer(_SpaceTokenizer())
    assert p.bad_words_token_ids == [[1], [2], [1, 4], [2, 4]]
