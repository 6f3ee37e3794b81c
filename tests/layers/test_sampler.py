"""Sampler against exact probabilities (20k draws per case, fixed seeds), penalties against a hand
computation, seeded reproducibility across batch compositions, bans and logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.layers.sampler import Sampler
from pagedllm.sample.metadata import build_sampling_metadata, make_generator
from pagedllm.sampling_params import SamplingParams

NUM_DRAWS = 20_000
BASE_LOGITS = [2.0, 1.5, 1.2, 0.3, 0.0, -0.4, -1.0, -2.5]
V = len(BASE_LOGITS)


def _metadata(
    params: list[SamplingParams], outputs: list[list[int]] | None = None, generators=None, prompts=None
):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return build_sampling_metadata(params, prompts, outputs, generators or {}, V, "cpu")


def _expected(
    logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
):
    """Independent float64 reference of vLLM's semantics: min-p, then top-k, then top-p (renormalized)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k:
        kth = np.sort(z[keep])[::-1][min(top_k, keep.sum()) - 1]
        keep &= z >= kth
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    order = np.argsort(-q)
    above = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
    keep_p = np.zeros_like(keep)
    keep_p[order] = above < top_p
    q = np.where(keep_p, q, 0.0)
    return q / q.sum()


def _chi2_limit(df: int) -> float:
    """~99.99% quantile of chi-square (Wilson-Hilferty), so a correct sampler fails with p < 1e-4."""
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _draw(params: SamplingParams, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    logits = torch.tensor([BASE_LOGITS] * NUM_DRAWS, dtype=torch.float32)
    out = Sampler()(logits, _metadata([params] * NUM_DRAWS))
    return np.bincount(out.sampled_token_ids.numpy(), minlength=V)


# Cut-offs sit near the probability boundaries of BASE_LOGITS, so a slightly wrong threshold changes
# the support and fails.
@pytest.mark.parametrize(
    ("kwargs", "seed"),
    [
        ({"temperature": 1.0}, 0),
        ({"temperature": 0.5}, 1),
        ({"temperature": 2.0}, 2),
        ({"temperature": 1.0, "top_k": 3}, 3),
        ({"temperature": 0.7, "top_k": 5}, 4),
        ({"temperature": 1.0, "top_p": 0.65}, 5),
        ({"temperature": 1.5, "top_p": 0.53}, 6),
        ({"temperature": 1.0, "min_p": 0.17}, 7),
        ({"temperature": 2.0, "min_p": 0.3}, 8),
        ({"temperature": 1.3, "top_k": 6, "top_p": 0.85, "min_p": 0.05}, 9),
    ],
)
def test_distribution_matches_exact_probabilities(kwargs: dict, seed: int) -> None:
    counts = _draw(SamplingParams(**kwargs), seed)
    expected = _expected(BASE_LOGITS, **kwargs)
    # Truncated tokens are never drawn.
    assert (counts[expected == 0] == 0).all(), (counts, expected)
    support = expected > 0
    exp_counts = expected[support] * NUM_DRAWS
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    df = int(support.sum()) - 1
    if df:
        assert chi2 < _chi2_limit(df), (chi2, counts, expected)
    tv = 0.5 * np.abs(counts / NUM_DRAWS - expected).sum()
    assert tv < 0.02


def test_reference_is_sensitive() -> None:
    """The chi-square test above rejects a wrong temperature (guards against a vacuous test)."""
    counts = _draw(SamplingParams(temperature=0.8), 11)
    expected = _expected(BASE_LOGITS, temperature=1.0)
    chi2 = float(((counts - expected * NUM_DRAWS) ** 2 / (expected * NUM_DRAWS)).sum())
    assert chi2 > _chi2_limit(V - 1)


def test_top_k_keeps_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]] * 4000)
    params = SamplingParams(top_k=2)
    torch.manual_seed(0)
    md = build_sampling_metadata([params] * 4000, [[]] * 4000, [[]] * 4000, {}, 5, "cpu")
    seen = set(Sampler()(logits, md).sampled_token_ids.tolist())
    assert seen == {1, 2, 3}


def test_greedy_and_random_rows_in_one_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, V)
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=5.0) for i in range(64)
    ]
    md = _metadata(params)
    assert not md.all_greedy and not md.all_random
    sampled = Sampler()(logits.clone(), md).sampled_token_ids
    greedy_rows = torch.arange(0, 64, 2)
    assert torch.equal(sampled[greedy_rows], logits[greedy_rows].argmax(-1))
    # At temperature 5 on 8 tokens the random rows cannot all be their argmax.
    random_rows = torch.arange(1, 64, 2)
    assert not torch.equal(sampled[random_rows], logits[random_rows].argmax(-1))


def test_all_greedy_is_argmax_of_processed_logits() -> None:
    logits = torch.tensor([BASE_LOGITS, BASE_LOGITS])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={7: 10.0})]
    md = _metadata(params)
    assert md.all_greedy and md.temperature is None
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0, 7]


def _seeded_run(row: int, batch: int, steps: int, seed: int, other_seed: int) -> list[int]:
    """Sample ``steps`` tokens for a seeded request placed at ``row`` among unrelated requests."""
    gen = torch.Generator().manual_seed(other_seed)
    generators = {row: make_generator(1234, "cpu")}
    if batch > 2:
        generators[(row + 1) % batch] = make_generator(99, "cpu")
    params = [SamplingParams(temperature=float(1 + i % 3), top_p=0.95) for i in range(batch)]
    params[row] = SamplingParams(temperature=0.9, top_k=6, seed=1234)
    torch.manual_seed(seed)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(batch, V, generator=gen)
        logits[row] = torch.tensor(BASE_LOGITS)
        md = _metadata(params, generators=generators)
        tokens.append(int(Sampler()(logits, md).sampled_token_ids[row]))
    return tokens


def test_seeded_request_independent_of_batch() -> None:
    alone = _seeded_run(row=0, batch=1, steps=30, seed=0, other_seed=0)
    assert len(set(alone)) > 1
    assert _seeded_run(row=3, batch=7, steps=30, seed=1, other_seed=5) == alone
    assert _seeded_run(row=15, batch=16, steps=30, seed=2, other_seed=6) == alone
    # A different seed gives a different stream.
    gen = {0: make_generator(4321, "cpu")}
    other = [
        int(
            Sampler()(
                torch.tensor([BASE_LOGITS]),
                _metadata([SamplingParams(temperature=0.9, top_k=6)], generators=gen),
            ).sampled_token_ids[0]
        )
        for _ in range(30)
    ]
    assert other != alone


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 0.25]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # Tokens 0 and 4 appear twice in the prompt: the repetition penalty still applies once.
    md = _metadata([params], outputs=[[3, 3, 1]], prompts=[[0, 4, 0, 4]])
    out = Sampler.process_logits(logits.clone(), md)
    # token 0: prompt, positive -> 2/2; token 1: output once, negative -> -1*2 - 0.5 - 0.25;
    # token 3: output twice -> 3/2 - 2*0.5 - 0.25; token 4: prompt, negative -> -2*2; others unchanged.
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -4.0, 1.0, 0.0, 0.25]])
    torch.testing.assert_close(out, expected)


def test_penalties_per_row_and_skipped_when_off() -> None:
    logits = torch.tensor([[1.0] * V, [1.0] * V])
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0)]
    md = _metadata(params, outputs=[[0, 1], [0, 1]], prompts=[[2], [2]])
    assert md.penalty_seen is None  # no repetition penalty anywhere: prompts are not looked at
    out = Sampler.process_logits(logits, md)
    assert out[0].tolist() == [1.0] * V
    assert out[1].tolist() == [0.0, 0.0] + [1.0] * (V - 2)
    assert _metadata([SamplingParams()] * 2).no_penalties


def test_logit_bias_allowed_ids_and_bad_words() -> None:
    logits = torch.zeros(3, V)
    params = [
        SamplingParams(temperature=0.0, logit_bias={5: 3.0, 2: -1.0}),
        SamplingParams(allowed_token_ids=[1, 6]),
        SamplingParams(),
    ]
    params[2].bad_words_token_ids = [[4], [6, 7]]
    md = _metadata(params, outputs=[[], [], [1, 6]])
    out = Sampler.process_logits(logits, md)
    assert out[0].tolist() == [0, 0, -1, 0, 0, 3, 0, 0]
    assert torch.isinf(out[1]).tolist() == [True, False, True, True, True, True, False, True]
    # 4 is banned outright; 7 only because the output ends with the bad word's prefix 6.
    assert torch.isinf(out[2]).tolist() == [False, False, False, False, True, False, False, True]
    md_no_prefix = _metadata([params[2]], outputs=[[6, 1]])
    assert (
        torch.isinf(Sampler.process_logits(torch.zeros(1, V), md_no_prefix)[0]).tolist()
        == [False] * 4 + [True] + [False] * 3
    )


def test_allowed_token_ids_restrict_random_draws() -> None:
    torch.manual_seed(0)
    n = 2000
    md = _metadata([SamplingParams(allowed_token_ids=[2, 5, 7])] * n)
    assert set(Sampler()(torch.tensor([BASE_LOGITS] * n), md).sampled_token_ids.tolist()) == {2, 5, 7}


def test_min_tokens_masks_stop_tokens() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    params.update_from_generation_config({}, model_eos_token_id=0)
    logits = torch.tensor([[5.0, 4.0, 3.0, 0, 0, 0, 0, 0]] * 2)
    md = _metadata([params, params], outputs=[[2, 2], [2, 2, 2]])
    # Below min_tokens both EOS (0) and the stop token (1) are masked; at min_tokens nothing is.
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, 0]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    ignore.update_from_generation_config({}, model_eos_token_id=0)
    md = _metadata([ignore], outputs=[[]])
    assert Sampler()(torch.tensor([[5.0, 4.0, 3.0, 0, 0, 0, 0, 0]]), md).sampled_token_ids.tolist() == [0]


def test_logprobs_are_raw_with_rank() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.5, top_k=2, logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=0.0, logprobs=-1),
    ]
    md = _metadata(params)
    assert md.max_num_logprobs == V and md.num_logprobs == [3, 0, None, V]
    out = Sampler()(logits.clone(), md)
    assert out.sampled_token_ids[0] == 7
    lp = out.logprobs
    assert lp is not None and lp.logprobs.shape == (4, 1 + V)
    rows = out.logprobs.to_request_lists(md.num_logprobs)
    assert rows[2] is None
    first = rows[0]
    assert first is not None and first.token_ids[0][0] == 7
    # The sampled token's logprob is from the raw distribution (the bias does not show).
    assert first.logprobs[0][0] == pytest.approx(float(raw[0, 7]), abs=1e-6)
    assert first.sampled_token_ranks[0] == int((raw[0] >= raw[0, 7]).sum())
    top3 = torch.topk(raw[0], 3)
    assert first.token_ids[0][1:] == top3.indices.tolist()
    assert first.logprobs[0][1:] == pytest.approx(top3.values.tolist(), abs=1e-6)
    second = rows[1]
    assert second is not None and len(second.token_ids[0]) == 1
    assert second.sampled_token_ranks[0] in (1, 2)  # top-k 2 keeps the two most likely
    last = rows[3]
    assert last is not None and last.sampled_token_ranks[0] == 1 and len(last.token_ids[0]) == 1 + V


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode: str) -> None:
    logits = torch.tensor([BASE_LOGITS, BASE_LOGITS])
    params = [
        SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=0),
        SamplingParams(temperature=0.0, logprobs=3, logit_bias={4: 1.0}),
    ]
    md = _metadata(params, generators={0: make_generator(0, "cpu")})
    out = Sampler(logprobs_mode=mode)(logits.clone(), md)
    assert out.logprobs is not None
    values = out.logprobs.logprobs
    base = torch.tensor(BASE_LOGITS)
    if mode == "raw_logits":
        assert values[0, 1:].tolist() == base.topk(3).values.tolist()
    else:
        processed_0 = torch.full((V,), float("-inf"))
        processed_0[:2] = base[:2] / 0.5
        processed_1 = base.clone()
        processed_1[4] += 1.0
        if mode == "processed_logprobs":
            processed_0, processed_1 = processed_0.log_softmax(-1), processed_1.log_softmax(-1)
        torch.testing.assert_close(values[0, 1:3], processed_0[:2])
        assert values[0, 3] == float("-inf")  # truncated by top-k
        torch.testing.assert_close(values[1, 1:], processed_1.topk(3).values)


def test_unknown_logprobs_mode() -> None:
    with pytest.raises(ValueError, match="logprobs_mode='final' is not supported"):
        Sampler(logprobs_mode="final")


def test_empty_batch() -> None:
    md = _metadata([])
    assert md.all_greedy and not md.all_random
    assert Sampler()(torch.zeros(0, V), md).sampled_token_ids.shape == (0,)
