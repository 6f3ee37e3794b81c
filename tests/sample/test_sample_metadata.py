"""The metadata builder: flags that let the sampler skip work, and the batched tensors."""

from __future__ import annotations

from pagedllm.sample.metadata import build_sampling_metadata, make_generator
from pagedllm.sampling_params import SamplingParams

V = 10


def _build(params, outputs=None, prompts=None, generators=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return build_sampling_metadata(params, prompts, outputs, generators or {}, V, "cpu")


def test_all_greedy_batch_carries_nothing() -> None:
    md = _build([SamplingParams(temperature=0.0)] * 3)
    assert md.all_greedy and not md.all_random and md.no_penalties
    fields = (md.temperature, md.greedy_mask, md.top_p, md.top_k, md.min_p, md.allowed_token_ids_mask)
    assert all(f is None for f in fields)
    assert md.logit_bias is None and md.banned is None and md.max_num_logprobs is None


def test_mixed_batch_tensors() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3, seed=5),
        SamplingParams(top_p=0.9, top_k=50, min_p=0.1, logprobs=4),
    ]
    gens = {1: make_generator(5, "cpu")}
    md = _build(params, generators=gens)
    assert not md.all_greedy and not md.all_random
    assert md.temperature is not None and md.temperature.tolist() == [1.0, 0.699999988079071, 1.0]
    assert md.greedy_mask is not None and md.greedy_mask.tolist() == [True, False, False]
    # top_k beyond the vocabulary is off (stored as the vocabulary size).
    assert md.top_k is not None and md.top_k.tolist() == [V, 3, V] and md.max_top_k == 3
    assert md.top_p is not None and md.top_p.tolist()[0] == 1.0
    assert md.min_p is not None and md.generators is gens
    assert md.max_num_logprobs == 4 and md.num_logprobs == [None, None, 4]


def test_penalty_entries_are_unique_pairs() -> None:
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.5), SamplingParams()]
    md = _build(params, outputs=[[1, 2, 1], [3, 3, 9, 3], [4]], prompts=[[2, 5], [6], [7]])
    assert not md.no_penalties and md.repetition_penalties is not None
    assert md.penalty_seen is not None and md.penalty_output is not None
    # Repetition: row 0 only, prompt and output merged; frequency/presence: row 1 only, with counts.
    assert list(zip(*(t.tolist() for t in md.penalty_seen))) == [(0, 1), (0, 2), (0, 5)]
    assert list(zip(*(t.tolist() for t in md.penalty_output))) == [(1, 3, 3.0), (1, 9, 1.0)]
    assert _build([SamplingParams(presence_penalty=1.0)], outputs=[[]]).penalty_output is None


def test_bans_and_bias_index_pairs() -> None:
    a = SamplingParams(logit_bias={1: 2.0, 4: -1.0})
    b = SamplingParams(min_tokens=2, stop_token_ids=[7, 8])
    b.bad_words_token_ids = [[3, 9]]
    md = _build([a, b], outputs=[[], [3]])
    assert md.logit_bias is not None
    rows, ids, values = md.logit_bias
    assert rows.tolist() == [0, 0] and ids.tolist() == [1, 4] and values.tolist() == [2.0, -1.0]
    assert md.banned is not None
    assert list(zip(*(t.tolist() for t in md.banned))) == [(1, 7), (1, 8), (1, 9)]
    # Once min_tokens is reached and the prefix is not there, nothing is banned.
    assert _build([b], outputs=[[3, 1]]).banned is None
