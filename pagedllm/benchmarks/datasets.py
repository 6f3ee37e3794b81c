"""Benchmark workloads: random token-id prompts of given lengths, or chat prompts from a JSONL file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class SampleRequest:
    output_len: int
    # Exactly one of these is set.
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    # The JSON schema the output must follow (the `json` workload).
    schema: dict[str, Any] | None = None

    @property
    def prompt_len(self) -> int | None:
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)


def parse_range(text: str) -> tuple[int, int]:
    """`"128"` -> (128, 128); `"128..512"` -> (128, 512) (inclusive)."""
    lo, sep, hi = text.partition("..")
    low, high = int(lo), int(hi) if sep else int(lo)
    if low < 1 or high < low:
        raise ValueError(f"invalid length range {text!r}: expected N or LOW..HIGH with 1 <= LOW <= HIGH")
    return low, high


def random_requests(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    special_ids: tuple[int, ...] = (),
) -> list[SampleRequest]:
    """Uniform random token ids (avoiding special tokens) with lengths drawn uniformly from `input_len`."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    return [
        SampleRequest(output_len=output_len, prompt_token_ids=rng.choice(allowed, size=int(n)).tolist())
        for n in lengths
    ]


def chat_requests(path: str | Path, num_prompts: int | None, output_len: int) -> list[SampleRequest]:
    """Chat conversations from a JSONL file whose rows hold a `messages` list (OpenAI format)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("messages"), list):
                raise ValueError(f"{path}:{lineno}: each row needs a 'messages' list")
            rows.append(SampleRequest(output_len=output_len, messages=row["messages"]))
    if num_prompts is not None:
        # Cycle through the file when more requests are asked than it holds.
        rows = [rows[i % len(rows)] for i in range(num_prompts)]
    return rows
