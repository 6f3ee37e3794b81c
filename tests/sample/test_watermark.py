"""The watermark's keyed randomness and the detector's null distributions, without a model.

Every test is deterministic (fixed keys, contexts and numpy seeds); the thresholds are chosen so that a
correct implementation would fail with the stated (small) probability over those fixed choices."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.layers.sampler import Sampler
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.watermark import (
    WatermarkBatch,
    Watermarker,
    fmix32,
    keyed_uniforms,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.watermark import binomial_sf, detect, gamma_sf

BASE_LOGITS = [2.0, 1.5, 1.2, 0.3, 0.0, -0.4, -1.0, -2.5]
V = len(BASE_LOGITS)
CONTEXT = [11, 12, 13, 14]


def _config(algorithm: str, key: int, alpha: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(algorithm=algorithm, key=key, alpha=alpha)


def _chi2_sf(chi2: float, df: int) -> float:
    """P(chi-square with df degrees of freedom >= chi2) = Q(df / 2, chi2 / 2)."""
    f64 = torch.float64
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=f64), torch.tensor(chi2 / 2, dtype=f64)))


def _sample_with_keys(algorithm: str, temperature: float, num_keys: int) -> np.ndarray:
    """One row per key, all with the same logits and context, through the real Sampler."""
    contexts = torch.tensor([CONTEXT], dtype=torch.int64)
    seeds = torch.cat([Watermarker(_config(algorithm, key)).seeds(contexts) for key in range(num_keys)])
    params = [SamplingParams(temperature=temperature)] * num_keys
    metadata = build_sampling_metadata(params, [[]] * num_keys, [[]] * num_keys, {}, V, "cpu")
    metadata.watermark = WatermarkBatch(
        rows=torch.arange(num_keys), exponentials=-torch.log(keyed_uniforms(seeds, torch.arange(V)))
    )
    logits = torch.tensor([BASE_LOGITS] * num_keys, dtype=torch.float32)
    return np.bincount(Sampler()(logits, metadata).sampled_token_ids.numpy(), minlength=V)


# Every expected count is >= 15 (the chi-square approximation holds).
@pytest.mark.parametrize(
    ("algorithm", "temperature", "num_keys"), [("gumbel", 1.0, 4000), ("dual_key_gumbel", 1.5, 1000)]
)
def test_gumbel_sampling_is_unbiased_over_keys(algorithm: str, temperature: float, num_keys: int) -> None:
    """Over keys, the keyed exponentials E_v are iid Exp(1), and argmax p_v / E_v picks v with
    probability p_v: the counts over num_keys keys are Multinomial(num_keys, p). Pearson's statistic is
    then ~ chi-square(V - 1); a correct sampler fails the p > 1e-3 test with probability 1e-3."""
    counts = _sample_with_keys(algorithm, temperature, num_keys)
    p = torch.softmax(torch.tensor(BASE_LOGITS, dtype=torch.float64) / temperature, 0).numpy()
    expected = p * num_keys
    assert expected.min() >= 15
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert _chi2_sf(chi2, V - 1) > 1e-3, (counts, expected)
    # The same test rejects a distorted sampler: the argmax of the keyed uniforms alone (uniform over
    # the vocabulary) is far from p, so the test is not vacuous.
    wrong = np.full(V, num_keys / V)
    assert _chi2_sf(float(((wrong - expected) ** 2 / expected).sum()), V - 1) < 1e-6


def test_prf_is_deterministic_and_32_bit() -> None:
    x = torch.tensor([0, 1, 2**32 - 1, 123456789], dtype=torch.int64)
    y = fmix32(x)
    assert ((y >= 0) & (y < 2**32)).all()

    # murmur3 fmix32 reference values (computed with Python's unbounded ints).
    def ref(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    assert y.tolist() == [ref(v) for v in x.tolist()]
    w = Watermarker(_config("gumbel", 7))
    contexts = torch.tensor([CONTEXT, CONTEXT, [11, 12, 13, 15]])
    seeds = w.seeds(contexts)
    assert seeds[0] == seeds[1] != seeds[2]
    assert not torch.equal(Watermarker(_config("gumbel", 8)).seeds(contexts), seeds)


def test_kgw_green_fraction_is_gamma() -> None:
    """Each (context, token) is green with probability gamma = 0.25: over 64 contexts x 1000 tokens
    (64000 Bernoulli draws, sd 0.0017) the fraction is within 0.01 of it."""
    w = Watermarker(_config("kgw", 3))
    seeds = w.seeds(torch.arange(64).reshape(64, 1))
    green = keyed_uniforms(seeds, torch.arange(1000)) < 0.25
    assert abs(float(green.double().mean()) - 0.25) < 0.01


@pytest.mark.parametrize("algorithm", ["gumbel", "dual_key_gumbel", "kgw"])
def test_detector_null_is_calibrated(algorithm: str) -> None:
    """Texts written without the key: the p-value is U(0, 1) (gumbel variants, continuous) or
    stochastically larger (kgw's discrete binomial tail), so of 200 texts the number with p < 0.05 is
    at most Binomial(200, 0.05) (mean 10, sd 3.1): 22 or more happens with probability < 1e-3."""
    rng = np.random.default_rng(0)
    p_values = [
        detect(rng.integers(0, 500, size=200).tolist(), key=99, algorithm=algorithm).p_value
        for _ in range(200)
    ]
    assert sum(p < 0.05 for p in p_values) < 22
    # And not degenerate (a detector answering 1 always would pass the line above).
    assert 0.4 < float(np.mean(p_values)) < 0.65


def test_detector_repeats_are_scored_once() -> None:
    """A looping text repeats its contexts: they are scored once, so the score cannot grow with the
    loop (which would make any repetitive text look watermarked)."""
    loop = [1, 2, 3, 4, 5, 6] * 40
    for algorithm in ("gumbel", "kgw"):
        assert detect(loop, key=1, algorithm=algorithm).num_scored_tokens <= 6


def test_p_value_helpers() -> None:
    # Q(1, x) = exp(-x); P(Bin(3, 0.5) >= 2) = 1/2; P(Bin(4, 0.25) >= 4) = 0.25**4.
    assert math.isclose(gamma_sf(2.0, 1), math.exp(-2.0))
    assert math.isclose(binomial_sf(2, 3, 0.5), 0.5)
    assert math.isclose(binomial_sf(4, 4, 0.25), 0.25**4)
    assert binomial_sf(0, 4, 0.25) == 1.0 and gamma_sf(0.0, 0) == 1.0
    with pytest.raises(ValueError, match="algorithm='aaronson'"):
        detect([1, 2, 3], key=1, algorithm="aaronson")
    with pytest.raises(ValueError, match="needs tokenizer= or model="):
        detect("some text", key=1)
