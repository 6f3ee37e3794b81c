"""Output watermarking in the sampler (`watermark_config`): keyed pseudo-random draws per context.

Every watermarked token is drawn with randomness that only the key and the `context_width` tokens
before it decide (a keyed hash, so the detector in `pagedllm.watermark` recomputes it from the text):

- `gumbel` (Aaronson's Gumbel-max): one keyed uniform r_v per candidate token v; the token is
  argmax_v p_v / E_v with E_v = -log r_v ~ Exp(1), i.e. the exponential race of `random_sample` run
  on keyed exponentials. Over keys, the E_v are iid Exp(1), so the token is distributed exactly as p
  (no distortion); for one key the chosen token has a large r, which the detector sees.
  A context already seen in this request's output is sampled ordinarily: the same key and context
  would repeat the same choice, the start of a loop (the detector skips repeated contexts too).
- `dual_key_gumbel`: two keys derived from `key`; a keyed coin per context (P(key B) = `alpha`) picks
  the one each token uses, so the detector knows it too.
- `kgw` (Kirchenbauer et al.): a keyed "green" set per previous token (each token green with
  probability KGW_GAMMA) gets KGW_DELTA added to its logits after temperature and truncation.

The hash is murmur3's 32-bit finalizer on int64 tensors with every product kept below 2**49
(`_mul32`), so it is exact and identical on every device and in numpy-free detection code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.sample.row_tokens import TokenRows

if TYPE_CHECKING:
    from pagedllm.config.features import WatermarkConfig


# Tokens of context hashed with the key (the spec's WatermarkConfig has no field for them): 4 for the
# Gumbel variants as vLLM's default; 1 (the previous token) for kgw as in its paper's "simple_1".
GUMBEL_CONTEXT_WIDTH = 4
KGW_CONTEXT_WIDTH = 1
# kgw's green fraction and logit boost (the paper's recommended 0.25 and 2.0).
KGW_GAMMA = 0.25
KGW_DELTA = 2.0

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
# Context slots before the first token of a sequence.
_NO_TOKEN = -1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without any int64 overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer: a bijection of [0, 2**32) that mixes every input bit into every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def derive_key(key: int, domain: bytes) -> int:
    """A 32-bit key of its own per use (`domain`), so the same user key never reuses one stream."""
    digest = hashlib.sha256(domain + key.to_bytes(16, "big", signed=True)).digest()
    return int.from_bytes(digest[:4], "big")


def context_seeds(key32: int, contexts: torch.Tensor) -> torch.Tensor:
    """[n, h] context token ids -> [n] int64 seeds in [0, 2**32): the key chained through the tokens."""
    seeds = torch.full(contexts.shape[:1], key32, dtype=torch.int64, device=contexts.device)
    for i in range(contexts.shape[1]):
        seeds = fmix32(seeds ^ (contexts[:, i] & _M32))
    return seeds


def keyed_uniforms(seeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, of each seed (rows) and candidate token (broadcast columns):
    `token_ids` is [V] (every token) or [n, 1] (one token per seed). One hash over the [rows, V]
    block: the tokens' own hashes (`fmix32(v * golden)`, distinct per token) only cost [V]."""
    token_hashes = fmix32((token_ids * _GOLDEN) & _M32)
    bits = fmix32(seeds[:, None] ^ token_hashes)
    return (bits.to(torch.float64) + 0.5) / 2.0**32


@dataclass
class WatermarkBatch:
    """The watermarked rows of one sampling step (indices into the sampler's batch)."""

    rows: torch.Tensor
    # [len(rows), vocab] float64 keyed Exp(1) draws (Gumbel variants), or None.
    exponentials: torch.Tensor | None = None
    # [len(rows), vocab] float32: KGW_DELTA on green tokens, 0 elsewhere (kgw), or None.
    green_bias: torch.Tensor | None = None


class Watermarker:
    """The keyed randomness of one `WatermarkConfig`, for the sampler and for the detector."""

    def __init__(self, config: WatermarkConfig | Any) -> None:
        self.algorithm: str = config.algorithm
        if self.algorithm not in ("gumbel", "dual_key_gumbel", "kgw"):
            raise ValueError(
                f"watermark algorithm {self.algorithm!r} is unknown; use gumbel, dual_key_gumbel or kgw"
            )
        key = int(config.key)
        self.alpha = float(config.alpha)
        self.context_width = KGW_CONTEXT_WIDTH if self.algorithm == "kgw" else GUMBEL_CONTEXT_WIDTH
        if self.algorithm == "dual_key_gumbel":
            self._keys = (derive_key(key, b"dual_key_gumbel/a"), derive_key(key, b"dual_key_gumbel/b"))
            self._route_key = derive_key(key, b"dual_key_gumbel/route")
        else:
            self._keys = (derive_key(key, self.algorithm.encode()),)

    @property
    def dedups_contexts(self) -> bool:
        """Gumbel variants sample a repeated context ordinarily and score only its first occurrence."""
        return self.algorithm != "kgw"

    def seeds(self, contexts: torch.Tensor) -> torch.Tensor:
        """[n, context_width] contexts -> [n] seeds of the key each position uses."""
        seeds = context_seeds(self._keys[0], contexts)
        if self.algorithm == "dual_key_gumbel":
            route = keyed_uniforms(
                context_seeds(self._route_key, contexts), torch.zeros_like(contexts[:, :1])
            )
            seeds = torch.where(route[:, 0] < self.alpha, context_seeds(self._keys[1], contexts), seeds)
        return seeds

    # ------------------------------------------------------------------------------------ sampler
    def batch(
        self,
        input_batch: TokenRows,
        rows: Sequence[int],
        params: Sequence[Any],
        vocab_size: int,
        device: torch.device,
    ) -> WatermarkBatch | None:
        """The keyed draws of the sampler's rows whose request is watermarked (`watermarking` resolved
        to True by the front-end's support check), or None when no row is."""
        marked = np.flatnonzero(np.fromiter((p.watermarking is True for p in params), bool, len(params)))
        if not marked.size:
            return None
        batch_rows = np.asarray(rows, dtype=np.int64)[marked]
        contexts = self._step_contexts(input_batch, batch_rows)
        if self.dedups_contexts:
            fresh = ~self._seen_in_output(input_batch, batch_rows, contexts)
            marked, contexts = marked[fresh], contexts[fresh]
            if not marked.size:
                return None
        seeds = self.seeds(torch.from_numpy(contexts).to(device))
        uniforms = keyed_uniforms(seeds, torch.arange(vocab_size, device=device))
        out = WatermarkBatch(rows=torch.from_numpy(marked).to(device))
        if self.algorithm == "kgw":
            out.green_bias = (uniforms < KGW_GAMMA).to(torch.float32) * KGW_DELTA
        else:
            out.exponentials = -torch.log(uniforms)
        return out

    def _step_contexts(self, input_batch: TokenRows, batch_rows: np.ndarray) -> np.ndarray:
        """The `context_width` tokens before each row's next token ([n, h] int64, _NO_TOKEN before
        the sequence start)."""
        idx = input_batch.num_tokens[batch_rows][:, None] - self.context_width + np.arange(self.context_width)
        tokens = input_batch.token_ids[batch_rows[:, None], np.maximum(idx, 0)]
        return np.where(idx >= 0, tokens, _NO_TOKEN)

    def _seen_in_output(
        self, input_batch: TokenRows, batch_rows: np.ndarray, contexts: np.ndarray
    ) -> np.ndarray:
        """Whether each row's context already preceded one of its generated tokens (vectorized over the
        rows: one window comparison over the longest sequence)."""
        h = self.context_width
        num_tokens = input_batch.num_tokens[batch_rows]
        longest = int(num_tokens.max())
        if longest <= h:
            return np.zeros(len(batch_rows), dtype=bool)
        # Window k holds tokens k .. k+h-1: the context of position k + h.
        windows = sliding_window_view(input_batch.token_ids[batch_rows, :longest], h, axis=1)
        same = (windows == contexts[:, None, :]).all(axis=-1)
        k = np.arange(windows.shape[1])
        first = input_batch.num_prompt_tokens[batch_rows][:, None] - h
        generated = (k >= first) & (k < (num_tokens - h)[:, None])
        return (same & generated).any(axis=1)


def gumbel_select(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """argmax_v p_v / E_v per row: the exponential race on keyed draws (float64, so that a tiny E_v
    never overflows and p_v = 0 never wins)."""
    return (probs.to(torch.float64) / exponentials).argmax(dim=-1)
