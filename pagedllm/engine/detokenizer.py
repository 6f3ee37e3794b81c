"""Incremental detokenization with stop strings, for the front-end (one detokenizer per request).

Each step decodes a short window of the latest tokens twice (up to the last emitted token, and up to
the newest one) and emits the difference, so streaming costs O(window) per token and the text equals
``tokenizer.decode(prompt + output)`` past the prompt's text. The window rules make that exact:
- text ending in "\\ufffd" is held back (a multi-byte UTF-8 character split across tokens);
- with a byte-fallback vocabulary (``<0xE4>`` tokens), text is held while the last visible token is a
  byte token: ByteFallback decodes a run of byte tokens all at once (one "\\ufffd" per byte if the run
  is not valid UTF-8), so a run may only be emitted whole, and a window never starts inside one;
- the first window (over the prompt's last tokens) never starts on text-less tokens such as skipped
  special tokens: SentencePiece decoders strip the leading space of the first token of a decode, which
  must be a token whose text was already counted.
``clean_up_tokenization_spaces`` is not applied (as vLLM V1).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams

# How many prompt tokens the first window starts with (they give the first output token its context).
_INITIAL_WINDOW = 5
# Give up looking for a clean window start this far back and decode from the start of the prompt.
_MAX_WINDOW_SEARCH = 32
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass
class _TokenizerInfo:
    """What the detokenizer needs from a tokenizer, computed once per tokenizer."""

    tokenizer: Any
    # The Rust `tokenizers.Tokenizer` of fast tokenizers (decoding without the HF wrapper's overhead).
    backend: Any
    special_ids: frozenset[int]
    byte_ids: frozenset[int]
    single_token_text: dict[int, str] = field(default_factory=dict)

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> str:
        if self.backend is not None:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


_INFO_CACHE: weakref.WeakKeyDictionary[Any, _TokenizerInfo] = weakref.WeakKeyDictionary()


def _tokenizer_info(tokenizer: Any) -> _TokenizerInfo:
    info = _INFO_CACHE.get(tokenizer)
    if info is not None:
        return info
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        byte_fallback = "ByteFallback" in repr(backend.decoder)
        vocab = backend.get_vocab(with_added_tokens=False) if byte_fallback else {}
    else:
        vocab = tokenizer.get_vocab()
    byte_ids = frozenset(i for tok, i in vocab.items() if _BYTE_TOKEN.match(tok))
    info = _TokenizerInfo(tokenizer, backend, frozenset(tokenizer.all_special_ids), byte_ids)
    _INFO_CACHE[tokenizer] = info
    return info


def decode_token_ids(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Each token id decoded on its own (``Logprob.decoded_token``); special tokens are kept."""
    info = _tokenizer_info(tokenizer)
    cache = info.single_token_text
    out = []
    for token_id in token_ids:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = info.decode([token_id], False, True)
        out.append(text)
    return out


class IncrementalDetokenizer:
    """Text and stop strings of one request, updated as its tokens arrive.

    ``tokenizer`` None (or ``params.detokenize`` False) keeps token ids only: the text stays empty."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_text = ""
        assert isinstance(params.stop, list)
        self.stop: list[str] = params.stop
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Streamed text lags this many characters so that a stop string is never half-sent.
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self._sent_offset = 0
        self._info = _tokenizer_info(tokenizer) if tokenizer is not None and params.detokenize else None
        self._skip = params.skip_special_tokens
        self._spaces = params.spaces_between_special_tokens
        self._stopped = False
        if self._info is not None:
            self._init_window()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    # ------------------------------------------------------------------------------------ windowing
    def _decode(self, start: int, end: int | None = None) -> str:
        assert self._info is not None
        return self._info.decode(self.token_ids[start:end], self._skip, self._spaces)

    def _visible(self, token_id: int) -> bool:
        assert self._info is not None
        return not (self._skip and token_id in self._info.special_ids)

    def _byte_run_open(self) -> bool:
        """Whether the last visible token is a byte-fallback token (its run may still grow)."""
        assert self._info is not None
        if not self._info.byte_ids:
            return False
        for token_id in reversed(self.token_ids):
            if self._visible(token_id):
                return token_id in self._info.byte_ids
        return False

    def _init_window(self) -> None:
        read = len(self.token_ids)
        start = max(read - _INITIAL_WINDOW, 0)
        text = self._decode(start, read)
        # Step back until the window starts at a clean place (see the module docstring).
        while start > 0 and (not text or text.startswith("\ufffd") or not self._clean_start(start)):
            start -= 1
            if read - start > _MAX_WINDOW_SEARCH:
                start = 0
            text = self._decode(start, read)
        self._prefix_offset, self._read_offset, self._prefix_text = start, read, text

    def _clean_start(self, start: int) -> bool:
        """A window may start at ``start`` if that does not split a run of byte tokens."""
        assert self._info is not None
        byte_ids = self._info.byte_ids
        return not (byte_ids and self.token_ids[start] in byte_ids and self.token_ids[start - 1] in byte_ids)

    def _next_text(self, flush: bool = False) -> str:
        """The text the tokens appended since the last emission add (empty while it must be held)."""
        if self._read_offset == len(self.token_ids):
            return ""
        text = self._decode(self._prefix_offset)
        if not flush and (
            len(text) <= len(self._prefix_text) or text.endswith("\ufffd") or self._byte_run_open()
        ):
            return ""
        new = text[len(self._prefix_text) :]
        # The next window starts at the first token of this emission, which ends on a complete
        # character outside any byte run.
        self._prefix_offset, self._prefix_text = self._read_offset, self._decode(self._read_offset)
        self._read_offset = len(self.token_ids)
        return new

    # ---------------------------------------------------------------------------------------- API
    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """Add the request's new tokens; return the stop string that ended it, if one appeared.

        ``stop_terminated``: the core ended the request on EOS or a stop token id, the last of the new
        tokens; its text is left out unless include_stop_str_in_output. ``finished``: this is the last
        update, so text held back for an incomplete character is released."""
        if self._info is None or self._stopped:
            self.token_ids.extend(new_token_ids)
            return None
        new_token_ids = list(new_token_ids)
        skipped = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped = new_token_ids.pop()
        check_from = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._next_text()
            # Text from the first min_tokens tokens cannot end the request.
            if len(self.token_ids) - self.num_prompt_tokens <= self.min_tokens:
                check_from = len(self.output_text)
        if finished or stop_terminated:
            self.output_text += self._next_text(flush=True)
        if skipped is not None:
            self.token_ids.append(skipped)
            # The request ended on that token: a later flush must not decode its text after all.
            self._read_offset = len(self.token_ids)
        return self._check_stop(check_from)

    def _check_stop(self, check_from: int) -> str | None:
        if not self.stop or len(self.output_text) == check_from:
            return None
        # The earliest stop string that ends in the new text wins.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, max(check_from - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self.include_stop_str_in_output else index]
        self._stopped = True
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report: all of it (``delta`` False) or only what is new since the last call. Until
        ``finished``, the last stop_buffer_length characters are held back (a stop string may start
        there); when finished, text held for an incomplete character is released too."""
        if finished and self._info is not None and not self._stopped:
            self.output_text += self._next_text(flush=True)
        length = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self.output_text[: max(length, 0)]
        start = self._sent_offset
        if length <= start:
            return ""
        self._sent_offset = length
        return self.output_text[start:length]
