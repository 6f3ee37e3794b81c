"""Sampling parameters of one request, with vLLM's fields, defaults and validation.

`SamplingParams` is a `msgspec.Struct` because it travels inside `EngineCoreRequest` over ZMQ. Fields
that a model's `generation_config.json` may override (temperature, top_p, ...) default to `UNSET`:
`__post_init__` replaces them with the engine default and records the ones the user gave in
`user_set_fields`, so `update_from_generation_config` applies model defaults only where the user set
nothing (also for a user who passes the engine default explicitly, e.g. `temperature=1.0`).
"""

from __future__ import annotations

import copy
import enum
import math
from typing import Any, Protocol

import msgspec
from msgspec import UNSET, UnsetType

from pagedllm.errors import RequestError
from pagedllm.structured_output.params import StructuredOutputsParams

# Temperatures below this mean greedy sampling (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# OpenAI's range of a logit bias (`clamp_logit_bias`).
LOGIT_BIAS_LIMIT = 100.0

# Engine defaults of the fields a generation config may override.
_OVERRIDABLE_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "max_tokens": 16,
}

# Flags: a truthy string such as "false" must not silently switch them on.
_BOOL_FIELDS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)

# generation_config.json spells a few of them differently.
_GENERATION_CONFIG_ALIASES = {"max_new_tokens": "max_tokens"}


class RequestOutputKind(enum.IntEnum):
    # Every output carries all text and tokens so far.
    CUMULATIVE = 0
    # Every output carries only what is new since the previous one.
    DELTA = 1
    # A single output when the request finishes.
    FINAL_ONLY = 2


class BeamSearchParams(msgspec.Struct, omit_defaults=True):
    """vLLM's beam search parameters (`LLM.beam_search`; the server builds them from use_beam_search, n
    as beam_width, length_penalty). Checked when a search starts."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    # Divides the cumulative logprob by the length to this power: > 1 favours longer beams.
    length_penalty: float = 1.0
    # vLLM's field; beam search stops at EOS only, so there is no stop string to include.
    include_stop_str_in_output: bool = False


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """How to sample the output tokens of one request (vLLM semantics)."""

    # Number of output sequences for the prompt (fanned out by the front-end).
    n: int = 1
    # vLLM's "sample best_of, return the n best": only best_of == n (nothing more to choose from) is taken,
    # as in vLLM V1; anything else is refused rather than silently answered with n samples.
    best_of: int | None = None
    # Penalise tokens already in the output once (OpenAI presence penalty), in [-2, 2].
    presence_penalty: float | UnsetType = UNSET
    # Penalise tokens by how often they appear in the output (OpenAI frequency penalty), in [-2, 2].
    frequency_penalty: float | UnsetType = UNSET
    # > 1 discourages tokens of the prompt and output, < 1 encourages them (CTRL's definition).
    repetition_penalty: float | UnsetType = UNSET
    # 0 (below 1e-5) means greedy.
    temperature: float | UnsetType = UNSET
    # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
    top_p: float | UnsetType = UNSET
    # Keep the top_k most likely tokens; 0 or -1 turns it off.
    top_k: int | UnsetType = UNSET
    # Drop tokens whose probability is below min_p times the most likely token's, in [0, 1].
    min_p: float | UnsetType = UNSET
    # Seed of this request's own random generator (same tokens whatever else is in the batch).
    seed: int | None = None
    # Strings that end the output; they are cut from the text unless include_stop_str_in_output.
    stop: str | list[str] | None = None
    # Token ids that end the output (kept in token_ids; not in the text unless special tokens are kept).
    stop_token_ids: list[int] | None = None
    # Keep generating after EOS.
    ignore_eos: bool = False
    # Maximum number of output tokens; None means up to the model's context.
    max_tokens: int | None | UnsetType = UNSET
    # EOS and stop token ids cannot end the output before this many tokens.
    min_tokens: int = 0
    # Number of log probabilities to return per output token (besides the sampled one); -1 = all.
    logprobs: int | None = None
    # Number of log probabilities to return per prompt token; -1 = all.
    prompt_logprobs: int | None = None
    # Produce text (False: token ids only).
    detokenize: bool = True
    skip_special_tokens: bool = True
    # Only slow (Python) tokenizers insert spaces around special tokens; fast ones ignore this, as in HF.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Token id -> value added to its logit before sampling (JSON string keys are accepted).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated; the front-end turns them into bad_words_token_ids.
    bad_words: list[str] | None = None
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (a dict is accepted too).
    structured_outputs: StructuredOutputsParams | None = None
    # Watermark the output (with watermark_config set): None follows the engine, False opts out. The
    # front-end resolves it to True/False with the spec's support check (greedy requests: False).
    watermarking: bool | None = None
    # vLLM's per-request logits processors (callables): refused unless empty, as vLLM V1 does (they cannot
    # cross to the engine-core process); logit_bias, allowed_token_ids and bad_words cover the common uses.
    logits_processors: list[Any] | None = None

    # Filled in by the front-end, not by users.
    # Every token id that ends the request (stop_token_ids plus EOS ids unless ignore_eos): the sampler
    # masks them while fewer than min_tokens tokens were generated.
    all_stop_token_ids: list[int] = []
    # bad_words as token id sequences (update_from_tokenizer).
    bad_words_token_ids: list[list[int]] = []
    # Names of the overridable fields the user set explicitly (None until __post_init__ ran).
    user_set_fields: frozenset[str] | None = None

    def __post_init__(self) -> None:
        # user_set_fields is only None on construction; a decoded struct carries it.
        if self.user_set_fields is None:
            user_set = set()
            for name, default in _OVERRIDABLE_DEFAULTS.items():
                value = getattr(self, name)
                # None also means "not set", except for max_tokens where None means "up to the context".
                if value is UNSET or (value is None and name != "max_tokens"):
                    setattr(self, name, default)
                else:
                    user_set.add(name)
            self.user_set_fields = frozenset(user_set)
        self._normalize()
        self._verify()

    # ----------------------------------------------------------------------------------- validation
    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_list("stop", self.stop, "a string or a list of strings")
        self.stop_token_ids = (
            [] if self.stop_token_ids is None else _as_list("stop_token_ids", self.stop_token_ids)
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        # A lone string would otherwise be taken character by character.
        self.bad_words = (
            [] if self.bad_words is None else _as_list("bad_words", self.bad_words, "a list of strings")
        )
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise RequestError("structured_outputs", f"structured_outputs: {e}") from e
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError(
                    "logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                )
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise RequestError(
                    "logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                ) from e
        if _check_number("temperature", self.temperature) < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change the argmax, so turn them off.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        all_stop = set(self.all_stop_token_ids) | set(self.stop_token_ids)
        self.all_stop_token_ids = sorted(all_stop)

    def _verify(self) -> None:
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.watermarking is not None and not isinstance(self.watermarking, bool):
            raise RequestError(
                "watermarking", f"watermarking must be True, False or None, got {self.watermarking!r}"
            )
        _check_int("n", self.n)
        if self.n < 1:
            raise RequestError("n", f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(
                "best_of", f"best_of={self.best_of!r} is not supported: only best_of equal to n={self.n}"
            )
        if self.logits_processors:
            raise RequestError(
                "logits_processors",
                "per-request logits_processors are not supported (use logit_bias, allowed_token_ids or bad_words)",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise RequestError(name, f"{name} must be in [-2, 2], got {value}")
        if not _check_number("repetition_penalty", self.repetition_penalty) > 0.0:
            raise RequestError(
                "repetition_penalty",
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}",
            )
        if not _check_number("temperature", self.temperature) >= 0.0:
            raise RequestError("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < _check_number("top_p", self.top_p) <= 1.0:
            raise RequestError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise RequestError("top_k", f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}")
        if not 0.0 <= _check_number("min_p", self.min_p) <= 1.0:
            raise RequestError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                raise RequestError("seed", f"seed must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise RequestError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise RequestError(
                "min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < -1:
                    raise RequestError(
                        name, f"{name} must be non-negative, or -1 for the whole vocabulary, got {value}"
                    )
        assert isinstance(self.stop, list)
        if not all(isinstance(s, str) for s in self.stop):
            raise RequestError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if "" in self.stop:
            raise RequestError("stop", "stop cannot contain an empty string")
        if self.stop and not self.detokenize:
            raise RequestError(
                "stop",
                "stop strings are only supported when detokenize is True; set detokenize=True to use stop",
            )
        assert self.stop_token_ids is not None
        for token_id in self.stop_token_ids:
            _check_token_id("stop_token_ids", token_id)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                _check_token_id("logit_bias", token_id)
                if not math.isfinite(bias):
                    raise RequestError(
                        "logit_bias", f"logit_bias values must be finite, got {bias} for token {token_id}"
                    )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise RequestError(
                    "allowed_token_ids", "allowed_token_ids must not be empty (None allows every token)"
                )
            for token_id in self.allowed_token_ids:
                _check_token_id("allowed_token_ids", token_id)
        assert self.bad_words is not None
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise RequestError(
                "bad_words", f"bad_words must be a list of non-blank strings, got {self.bad_words!r}"
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise RequestError(
                "structured_outputs",
                f"structured_outputs must be a StructuredOutputsParams or a dict, got {self.structured_outputs!r}",
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError as e:
                raise RequestError(
                    "output_kind", f"output_kind must be one of {[k.name for k in RequestOutputKind]}"
                ) from e

    def verify(self, max_logprobs: int, vocab_size: int) -> None:
        """Checks that depend on the model: logprob counts and token ids within the vocabulary.

        ``max_logprobs`` is ModelConfig.max_logprobs (-1: no limit)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            requested = vocab_size if value == -1 else value
            if max_logprobs != -1 and requested > max_logprobs:
                raise RequestError(
                    name, f"{name}={requested} is more than the model's max_logprobs={max_logprobs}"
                )
        ids = {
            "stop_token_ids": self.stop_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
            "allowed_token_ids": self.allowed_token_ids or [],
            "bad_words": [t for seq in self.bad_words_token_ids for t in seq],
        }
        for name, token_ids in ids.items():
            bad = sorted({t for t in token_ids if not 0 <= t < vocab_size})
            if bad:
                raise RequestError(
                    name, f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad}"
                )

    # ------------------------------------------------------------------------------------- helpers
    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """A deep copy (the lists and dicts are not shared)."""
        return copy.deepcopy(self)

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Apply a model's generation defaults to the fields the user did not set, and register EOS.

        ``generation_config`` is the dict of generation_config.json (or ModelConfig's
        get_diff_sampling_param()); unknown keys are ignored. Extra EOS ids of the generation config
        become stop_token_ids (so the scheduler stops on them) unless ignore_eos."""
        assert self.user_set_fields is not None
        for key, value in generation_config.items():
            name = _GENERATION_CONFIG_ALIASES.get(key, key)
            if name in _OVERRIDABLE_DEFAULTS and name not in self.user_set_fields and value is not None:
                setattr(self, name, value)
        eos_ids: set[int] = set()
        if model_eos_token_id is not None:
            eos_ids.add(model_eos_token_id)
        gen_eos = generation_config.get("eos_token_id")
        if gen_eos is not None:
            gen_eos_ids = {gen_eos} if isinstance(gen_eos, int) else set(gen_eos)
            if not self.ignore_eos:
                assert self.stop_token_ids is not None
                extra = sorted(gen_eos_ids - eos_ids - set(self.stop_token_ids))
                self.stop_token_ids = self.stop_token_ids + extra
            eos_ids |= gen_eos_ids
        if not self.ignore_eos:
            self.all_stop_token_ids = sorted(set(self.all_stop_token_ids) | eos_ids)
        self._normalize()
        self._verify()

    def update_from_tokenizer(self, tokenizer: _Tokenizer) -> None:
        """Turn bad_words into token id sequences, at the start of the text and after a space."""
        assert self.bad_words is not None
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                continue
            sequences.append(plain)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            # The spaced form is a different word only when it tokenizes to a new first token with the
            # same length; otherwise the leading space became a token of its own and plain covers it.
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        self.bad_words_token_ids = sequences


def clamp_logit_bias(logit_bias: dict[Any, Any] | None) -> dict[Any, Any] | None:
    """Each finite bias within OpenAI's [-100, 100], as vLLM's server does for requests (beyond it a bias
    only saturates the distribution further); anything else is left for validation to refuse."""
    if logit_bias is None or not isinstance(logit_bias, dict):
        return logit_bias

    def clamp(bias: Any) -> Any:
        finite = isinstance(bias, int | float) and not isinstance(bias, bool) and math.isfinite(bias)
        return min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias)) if finite else bias

    return {token: clamp(bias) for token, bias in logit_bias.items()}


def _check_number(name: str, value: Any) -> float:
    # Infinities are rejected too: inf * a logit (repetition penalty) or logit / inf turn into NaN or a
    # silently uniform distribution rather than an error.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(name, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _as_list(name: str, value: Any, expected: str = "a list of token ids") -> list[Any]:
    if isinstance(value, str | bytes | dict) or not isinstance(value, list | tuple):
        raise RequestError(name, f"{name} must be {expected}, got {value!r}")
    return list(value)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"{name} must be an integer, got {value!r}")


def _check_token_id(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(name, f"{name} must contain non-negative integer token ids, got {value!r}")
