"""The watermark detector: how likely a text is to carry a key's watermark (`pagedllm watermark detect`).

It recomputes, from the text's own tokens, the keyed uniform r_t = r(key, context_t, token_t) that the
sampler used (pagedllm.sample.watermark) and tests the null hypothesis "this text was written without
this key". Under the null the text is independent of the key, so for distinct scored positions the
r_t are independent U(0, 1):

- gumbel / dual_key_gumbel: score S = sum_t -log(1 - r_t), a sum of n iid Exp(1) under the null, so
  S ~ Gamma(n, 1) and p = P(Gamma(n, 1) >= S), the regularized upper incomplete gamma Q(n, S).
  Watermarked tokens were chosen for a large r_t, which makes S large.
- kgw: token t is green when r_t < KGW_GAMMA; under the null the green count G ~ Binomial(n, gamma),
  p = P(Binomial(n, gamma) >= G) (exact tail); the score is KGW's z-score
  z = (G - gamma n) / sqrt(n gamma (1 - gamma)).

Scored positions are those with a full context (the first `context_width` tokens are not), counted
once per context (Gumbel variants, matching the sampler, which samples a repeated context ordinarily)
or once per (context, token) pair (kgw): a repeated pair would repeat the same r_t, breaking
independence and inflating the score of repetitive text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.sample.watermark import KGW_GAMMA, Watermarker, keyed_uniforms

ALGORITHMS = ("gumbel", "dual_key_gumbel", "kgw")


@dataclass(frozen=True)
class WatermarkDetection:
    algorithm: str
    # Gumbel variants: sum of -log(1 - r_t); kgw: the z-score of the green count.
    score: float
    # P(a score at least this large | the text does not carry the key's watermark).
    p_value: float
    num_scored_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Params:
    """The WatermarkConfig fields the detector needs (it runs without an engine)."""

    algorithm: str
    key: int
    alpha: float


def detect(
    text_or_token_ids: str | Sequence[int],
    key: int,
    algorithm: str = "gumbel",
    *,
    alpha: float = 0.5,
    tokenizer: Any | None = None,
    model: str | None = None,
) -> WatermarkDetection:
    """Score a text (tokenized with `tokenizer`, or the tokenizer of `model`) or its token ids against
    `key`; `algorithm` and `alpha` as in the generating engine's watermark_config."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not a watermark algorithm; use one of {ALGORITHMS}")
    if isinstance(text_or_token_ids, str):
        if tokenizer is None:
            if model is None:
                raise ValueError(
                    "detecting a watermark in text needs tokenizer= or model= (token ids do not)"
                )
            from pagedllm.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(model)
        token_ids = list(tokenizer.encode(text_or_token_ids, add_special_tokens=False))
    else:
        token_ids = [int(t) for t in text_or_token_ids]
    watermarker = Watermarker(_Params(algorithm, int(key), float(alpha)))
    uniforms = _scored_uniforms(watermarker, np.asarray(token_ids, dtype=np.int64))
    n = int(uniforms.numel())
    if algorithm == "kgw":
        green = int((uniforms < KGW_GAMMA).sum())
        z = (green - KGW_GAMMA * n) / math.sqrt(n * KGW_GAMMA * (1 - KGW_GAMMA)) if n else 0.0
        return WatermarkDetection(algorithm, z, binomial_sf(green, n, KGW_GAMMA), n)
    score = float(-torch.log1p(-uniforms).sum()) if n else 0.0
    return WatermarkDetection(algorithm, score, gamma_sf(score, n), n)


def _scored_uniforms(watermarker: Watermarker, tokens: np.ndarray) -> torch.Tensor:
    """The keyed uniform of each scored token (see the module doc for which are scored)."""
    h = watermarker.context_width
    if tokens.size <= h:
        return torch.zeros(0, dtype=torch.float64)
    contexts = sliding_window_view(tokens, h)[:-1]  # the h tokens before each of tokens[h:]
    targets = tokens[h:]
    keys = contexts if watermarker.dedups_contexts else np.concatenate([contexts, targets[:, None]], axis=1)
    _, first = np.unique(keys, axis=0, return_index=True)
    first.sort()
    seeds = watermarker.seeds(torch.from_numpy(np.ascontiguousarray(contexts[first])))
    return keyed_uniforms(seeds, torch.from_numpy(targets[first])[:, None])[:, 0]


def gamma_sf(x: float, n: int) -> float:
    """P(Gamma(n, 1) >= x): the regularized upper incomplete gamma Q(n, x); 1 when nothing is scored."""
    if n == 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(float(n), dtype=torch.float64), torch.tensor(x, dtype=torch.float64)
        )
    )


def binomial_sf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= k), summed exactly in log space (n is a text's length: cheap)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    terms = [
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(p)
        + (n - i) * math.log1p(-p)
        for i in range(k, n + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))
