"""InputProcessor: prompt forms, validation messages, generation defaults, EOS and bad words."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.errors import RequestError
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer


@dataclass
class FakeModelConfig:
    max_model_len: int = 64
    max_logprobs: int = 5
    vocab_size: int = 49152
    generation: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=lambda: [2])

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return dict(self.generation)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    return get_tokenizer(smollm2_gguf)


def make(tokenizer: Any, **config: Any) -> InputProcessor:
    return InputProcessor(FakeModelConfig(**config), tokenizer)


def test_prompt_forms(tokenizer: Any) -> None:
    processor = make(tokenizer)
    ids = tokenizer.encode("Hello there")
    request, text = processor.process_inputs("a", "Hello there", SamplingParams(max_tokens=4))
    assert request.prompt_token_ids == ids and text == "Hello there"
    assert request.request_id == "a" and request.eos_token_id == 2
    request, text = processor.process_inputs("b", {"prompt": "Hello there"}, None)
    assert request.prompt_token_ids == ids and text == "Hello there"
    request, text = processor.process_inputs("c", {"prompt_token_ids": [5, 6, 7]}, None)
    assert request.prompt_token_ids == [5, 6, 7] and text is None
    request, text = processor.process_inputs("d", {"prompt_token_ids": (5, 6), "prompt": "xy"}, None)
    assert request.prompt_token_ids == [5, 6] and text == "xy"


def test_arrival_time_and_priority(tokenizer: Any) -> None:
    processor = InputProcessor(FakeModelConfig(), tokenizer, scheduling_policy="priority")
    request, _ = processor.process_inputs("a", "Hi", None, arrival_time=12.5, priority=3)
    assert request.arrival_time == 12.5 and request.priority == 3


def test_priority_without_priority_scheduling_is_refused(tokenizer: Any) -> None:
    # First come, first served ignores priorities: a request that sets one learns so.
    with pytest.raises(RequestError, match="priority=-1 has no effect.*'fcfs'") as info:
        make(tokenizer).process_inputs("a", "Hi", None, priority=-1)
    assert info.value.param == "priority"
    assert make(tokenizer).process_inputs("a", "Hi", None, priority=0)[0].priority == 0


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ("", ValueError, "The prompt is empty"),
        ({"prompt_token_ids": []}, ValueError, "The prompt is empty"),
        ({"prompt_token_ids": [1, "2"]}, TypeError, "list of integers"),
        ({"prompt_token_ids": "12"}, TypeError, "list of integers"),
        ({"text": "hi"}, ValueError, "needs 'prompt' or 'prompt_token_ids'"),
        (42, TypeError, "a prompt must be"),
        (
            {"prompt_token_ids": [1, 49152, -3]},
            ValueError,
            r"outside the vocabulary \[0, 49152\): \[-3, 49152\]",
        ),
    ],
)
def test_bad_prompts(tokenizer: Any, prompt: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        make(tokenizer).process_inputs("a", prompt, None)
    # Refusals of the prompt name it (the server's `param`); a prompt of the wrong Python type is the
    # offline caller's TypeError.
    assert error is TypeError or getattr(info.value, "param", None) == "prompt"


def test_prompt_too_long(tokenizer: Any) -> None:
    processor = make(tokenizer, max_model_len=8)
    with pytest.raises(RequestError, match="prompt has 9 tokens, but the maximum model length is 8") as info:
        processor.process_inputs("a", {"prompt_token_ids": [1] * 9}, None)
    assert info.value.param == "prompt"
    # A prompt that fills the context exactly leaves no room for even one output token.
    with pytest.raises(ValueError, match="prompt has 8 tokens.*no room"):
        processor.process_inputs("a", {"prompt_token_ids": [1] * 8}, None)


def test_max_tokens_room(tokenizer: Any) -> None:
    processor = make(tokenizer, max_model_len=16)
    prompt = {"prompt_token_ids": [1] * 10}
    with pytest.raises(
        RequestError, match="max_tokens=7 is too large: the prompt has 10 tokens.*at most 6"
    ) as info:
        processor.process_inputs("a", prompt, SamplingParams(max_tokens=7))
    assert info.value.param == "max_tokens"
    request, _ = processor.process_inputs("a", prompt, SamplingParams(max_tokens=6))
    assert request.sampling_params.max_tokens == 6
    # None means "up to the context".
    request, _ = processor.process_inputs("a", prompt, SamplingParams(max_tokens=None))
    assert request.sampling_params.max_tokens == 6
    # The default of 16 does not fit: it is cut to the room left rather than rejected.
    request, _ = processor.process_inputs("a", prompt, SamplingParams())
    assert request.sampling_params.max_tokens == 6
    with pytest.raises(RequestError, match="min_tokens=8 is more than max_tokens=6") as info:
        processor.process_inputs("a", prompt, SamplingParams(min_tokens=8, max_tokens=None))
    assert info.value.param == "min_tokens"


def test_logprobs_limit(tokenizer: Any) -> None:
    processor = make(tokenizer, max_logprobs=5)
    processor.process_inputs("a", "Hi", SamplingParams(logprobs=5, prompt_logprobs=5))
    with pytest.raises(ValueError, match="logprobs=6 is more than the model's max_logprobs=5"):
        processor.process_inputs("a", "Hi", SamplingParams(logprobs=6))
    with pytest.raises(ValueError, match="prompt_logprobs=49152 is more than"):
        processor.process_inputs("a", "Hi", SamplingParams(prompt_logprobs=-1))


def test_sampling_token_ids_within_vocab(tokenizer: Any) -> None:
    processor = make(tokenizer, vocab_size=100)
    with pytest.raises(
        ValueError, match=r"allowed_token_ids contains token ids outside the vocabulary \[0, 100\)"
    ):
        processor.process_inputs("a", {"prompt_token_ids": [1]}, SamplingParams(allowed_token_ids=[5, 100]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        processor.process_inputs("a", {"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[250]))


def test_bad_words_become_token_ids(tokenizer: Any) -> None:
    request, _ = make(tokenizer).process_inputs("a", "Hi", SamplingParams(bad_words=["hello", "big dog"]))
    sequences = request.sampling_params.bad_words_token_ids
    assert tokenizer.encode("hello", add_special_tokens=False) in sequences
    assert tokenizer.encode(" hello", add_special_tokens=False) in sequences
    assert tokenizer.encode("big dog", add_special_tokens=False) in sequences


def test_generation_defaults_only_where_unset(tokenizer: Any) -> None:
    processor = make(tokenizer, generation={"temperature": 0.6, "top_p": 0.9, "max_tokens": 20})
    defaults, _ = processor.process_inputs("a", "Hi", None)
    assert (defaults.sampling_params.temperature, defaults.sampling_params.top_p) == (0.6, 0.9)
    assert defaults.sampling_params.max_tokens == 20
    user = SamplingParams(temperature=1.0, max_tokens=3)
    request, _ = processor.process_inputs("b", "Hi", user)
    assert request.sampling_params.temperature == 1.0  # set explicitly, even to the engine default
    assert request.sampling_params.top_p == 0.9
    assert request.sampling_params.max_tokens == 3
    # The caller's object is never changed (it may be shared by many prompts).
    assert user.top_p == 1.0 and user.bad_words_token_ids == []
    assert processor.default_sampling_params().temperature == 0.6


def test_extra_eos_ids_become_stop_ids(tokenizer: Any) -> None:
    processor = make(tokenizer, eos_token_ids=[2, 7, 9])
    request, _ = processor.process_inputs("a", "Hi", SamplingParams(max_tokens=2))
    assert request.eos_token_id == 2
    assert set(request.sampling_params.stop_token_ids) == {7, 9}
    assert {2, 7, 9} <= set(request.sampling_params.all_stop_token_ids)
    request, _ = processor.process_inputs("a", "Hi", SamplingParams(max_tokens=2, ignore_eos=True))
    assert request.sampling_params.stop_token_ids == []


def test_tokenizer_eos_when_config_has_none(tokenizer: Any) -> None:
    processor = make(tokenizer, eos_token_ids=[])
    request, _ = processor.process_inputs("a", "Hi", None)
    assert request.eos_token_id == tokenizer.eos_token_id


def test_text_prompt_without_tokenizer() -> None:
    processor = InputProcessor(FakeModelConfig(), None)
    request, _ = processor.process_inputs("a", {"prompt_token_ids": [3, 4]}, None)
    assert request.prompt_token_ids == [3, 4]
    with pytest.raises(ValueError, match="need a tokenizer"):
        processor.process_inputs("a", "text", None)
