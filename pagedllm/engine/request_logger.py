"""`RequestLogger`: the request log of `--enable-log-requests`, as vLLM's.

Each request is logged when it is received (id, prompt text and token ids, sampling parameters) and
each of its output sequences when it finishes (text, token ids, finish reason). `--max-log-len N` keeps
the first N characters of every text and the first N ids of every token list, so a long prompt cannot
flood the log; unset logs them whole.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

logger = logging.getLogger("pagedllm.engine.request_logger")

_Seq = TypeVar("_Seq", str, Sequence[int])


class RequestLogger:
    def __init__(self, max_log_len: int | None) -> None:
        self.max_log_len = max_log_len

    def _cut(self, value: _Seq | None) -> _Seq | None:
        if value is None or self.max_log_len is None:
            return value
        return value[: self.max_log_len]

    def log_inputs(
        self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int] | None, params: Any
    ) -> None:
        token_ids = self._cut(prompt_token_ids)
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s.",
            request_id,
            self._cut(prompt),
            params,
            None if token_ids is None else list(token_ids),
        )

    def log_outputs(
        self, request_id: str, text: str | None, token_ids: Sequence[int], finish_reason: str | None
    ) -> None:
        ids = self._cut(token_ids)
        logger.info(
            "Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s",
            request_id,
            self._cut(text),
            None if ids is None else list(ids),
            finish_reason,
        )
