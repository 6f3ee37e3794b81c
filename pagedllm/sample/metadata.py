"""The batched sampling inputs of one step, built from the running requests' SamplingParams.

The model runner calls `build_sampling_metadata` once per step for the rows it samples. Everything a
common batch does not use stays None (and a flag says so), so the sampler skips that work: an all-greedy
batch without penalties or bans is a single argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample.watermark import WatermarkBatch
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    # [num_reqs] float32 with 1.0 on greedy rows; None when every row is greedy.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [num_reqs] bool, True on greedy rows; only for mixed batches.
    greedy_mask: torch.Tensor | None
    # [num_reqs] float32 (1.0 = off) / int64 (vocab_size = off) / float32 (0 = off); None if no row uses it.
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    # Largest top_k in use (a host int: the sampler needs it without a device sync); None without top-k.
    max_top_k: int | None
    # Row index -> generator of a seeded request; the other rows use the default generator.
    generators: dict[int, torch.Generator]
    # Largest logprobs count of the batch (-1 resolved to the vocabulary size); None if no row asks.
    max_num_logprobs: int | None
    # Each row's own logprobs count (None: not asked), to trim the batch's top-k per request.
    num_logprobs: list[int | None]
    no_penalties: bool
    # [num_reqs] float32 each; None when no_penalties.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # Unique (rows, token ids) in the prompt or output of rows with a repetition penalty.
    penalty_seen: tuple[torch.Tensor, torch.Tensor] | None
    # Unique (rows, token ids, counts as float32) of the outputs, for frequency/presence penalties.
    penalty_output: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # [num_reqs, vocab] bool, True = not allowed (rows with allowed_token_ids); None if no row has them.
    allowed_token_ids_mask: torch.Tensor | None
    # (rows, token ids, values) of logit_bias entries.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (rows, token ids) to set to -inf: bad words whose prefix was just generated, and stop tokens of
    # rows below min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # Keyed draws of the watermarked rows (set by the model runner's Watermarker); None: no row is.
    watermark: WatermarkBatch | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator of a seeded request (keep it for the request's whole life)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Batch the sampling inputs of ``params`` (one per sampled row, in row order).

    ``prompt_token_ids`` / ``output_token_ids`` are each row's prompt and its output so far (needed for
    penalties, bad words and min_tokens); ``generators`` maps row indices to the generators of seeded
    requests (see make_generator)."""
    num_reqs = len(params)
    greedy = [p.temperature < SAMPLING_EPS for p in params]
    all_greedy = all(greedy)
    # An empty batch counts as all-greedy (an argmax over no rows), never as both.
    all_random = bool(greedy) and not any(greedy)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    temperature = greedy_mask = top_p = top_k = min_p = None
    max_top_k = None
    if not all_greedy:
        temperature = tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
        if not all_random:
            greedy_mask = tensor(greedy, torch.bool)
        if any(p.top_p < 1.0 for p in params):
            top_p = tensor([p.top_p for p in params], torch.float32)
        ks = [p.top_k for p in params if 0 < p.top_k < vocab_size]
        if ks:
            top_k = tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64)
            max_top_k = max(ks)
        if any(p.min_p > 0.0 for p in params):
            min_p = tensor([p.min_p for p in params], torch.float32)

    num_logprobs = [
        None if p.logprobs is None else (vocab_size if p.logprobs == -1 else p.logprobs) for p in params
    ]
    asked = [k for k in num_logprobs if k is not None]

    use_presence = any(p.presence_penalty != 0.0 for p in params)
    use_frequency = any(p.frequency_penalty != 0.0 for p in params)
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    no_penalties = not (use_presence or use_frequency or use_repetition)
    presence = frequency = repetition = penalty_seen = penalty_output = None
    if not no_penalties:
        presence = tensor([p.presence_penalty for p in params], torch.float32)
        frequency = tensor([p.frequency_penalty for p in params], torch.float32)
        repetition = tensor([p.repetition_penalty for p in params], torch.float32)
        if use_presence or use_frequency:
            rows = [
                i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            ]
            keys, counts = np.unique(_pair_keys(rows, output_token_ids, vocab_size), return_counts=True)
            if keys.size:
                penalty_output = (
                    *_split_keys(keys, vocab_size, device),
                    tensor(counts.tolist(), torch.float32),
                )
        if use_repetition:
            rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
            both = np.concatenate(
                [
                    _pair_keys(rows, prompt_token_ids, vocab_size),
                    _pair_keys(rows, output_token_ids, vocab_size),
                ]
            )
            keys = np.unique(both)
            if keys.size:
                penalty_seen = _split_keys(keys, vocab_size, device)

    allowed_mask = None
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed_rows:
        mask = np.zeros((num_reqs, vocab_size), dtype=bool)
        for i in allowed_rows:
            mask[i] = True
            mask[i, params[i].allowed_token_ids] = False
        allowed_mask = torch.from_numpy(mask).to(device)

    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += list(p.logit_bias)
            bias_values += list(p.logit_bias.values())
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens and p.all_stop_token_ids:
            ban_rows += [i] * len(p.all_stop_token_ids)
            ban_ids += p.all_stop_token_ids
        for word in p.bad_words_token_ids:
            prefix_len = len(word) - 1
            output = output_token_ids[i]
            if prefix_len == 0 or (len(output) >= prefix_len and list(output[-prefix_len:]) == word[:-1]):
                ban_rows.append(i)
                ban_ids.append(word[-1])
    logit_bias = None
    if bias_rows:
        logit_bias = (
            tensor(bias_rows, torch.int64),
            tensor(bias_ids, torch.int64),
            tensor(bias_values, torch.float32),
        )
    banned = (tensor(ban_rows, torch.int64), tensor(ban_ids, torch.int64)) if ban_rows else None

    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        greedy_mask=greedy_mask,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_top_k=max_top_k,
        generators=generators,
        max_num_logprobs=max(asked) if asked else None,
        num_logprobs=num_logprobs,
        no_penalties=no_penalties,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        penalty_seen=penalty_seen,
        penalty_output=penalty_output,
        allowed_token_ids_mask=allowed_mask,
        logit_bias=logit_bias,
        banned=banned,
    )


def _pair_keys(rows: list[int], token_ids: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """row * vocab_size + token id for every token of the given rows (one int64 key per pair)."""
    arrays = [np.asarray(token_ids[i], dtype=np.int64) for i in rows]
    if not arrays:
        return np.zeros(0, dtype=np.int64)
    row_ids = np.repeat(np.asarray(rows, dtype=np.int64), [a.size for a in arrays])
    return row_ids * vocab_size + np.concatenate(arrays)


def _split_keys(
    keys: np.ndarray, vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, ids = np.divmod(keys, vocab_size)
    return torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device)
