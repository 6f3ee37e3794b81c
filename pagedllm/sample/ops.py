"""Batched logit transforms and the random draw, one tensor op per step for the whole batch.

Order (vLLM V1): logit bias, penalties and bans act on the raw logits; then temperature; then min-p,
top-k and top-p truncate the distribution; then one exponential race draws every random row.
All functions work in place on ``logits`` [num_reqs, vocab] float32 and return it.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's arithmetic: repetition penalty divides positive / multiplies negative logits of tokens seen
    in the prompt or the output; frequency and presence penalties (OpenAI) count the output only.

    Token id tensors are right-padded with ``vocab_size`` (a bin that is dropped)."""
    num_reqs, vocab_size = logits.shape
    output_counts = _bin_counts(output_token_ids, num_reqs, vocab_size)
    output_mask = output_counts > 0
    seen = output_mask
    if prompt_token_ids is not None:
        seen = seen | (_bin_counts(prompt_token_ids, num_reqs, vocab_size) > 0)
    penalties = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits.mul_(torch.where(logits > 0, 1.0 / penalties, penalties))
    logits.sub_(frequency_penalties.unsqueeze(1) * output_counts)
    logits.sub_(presence_penalties.unsqueeze(1) * output_mask)
    return logits


def _bin_counts(token_ids: torch.Tensor, num_reqs: int, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros((num_reqs, vocab_size + 1), dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``temperature`` [num_reqs] already holds 1.0 for greedy rows (they never divide by zero)."""
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times that of the most likely token.

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed."""
    max_logits = logits.amax(dim=-1, keepdim=True)
    threshold = max_logits + torch.log(min_p).unsqueeze(1)  # log(0) = -inf keeps every token
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """Keep the top_k largest logits (ties with the k-th are kept), then the smallest set of tokens whose
    renormalized probability reaches top_p (always at least one).

    ``top_k`` holds the vocabulary size for rows without top-k; ``top_p`` holds 1.0 for rows without it.
    ``max_top_k`` (the largest top_k in use, a host int) lets top-k alone skip the full sort without
    reading it back from the device."""
    if top_p is None:
        if top_k is None:
            return logits
        if max_top_k is None:
            max_top_k = int(top_k.masked_fill(top_k >= logits.shape[1], 1).max())
        return _apply_top_k_only(logits, top_k, max_top_k)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[1]
    if top_k is not None:
        # The k-th largest value is at position vocab - k of the ascending sort.
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    # Drop the low tail whose total mass stays within 1 - p; the largest token always survives.
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """top-k without a full sort: one topk of the batch's largest k, then a threshold per row."""
    vocab_size = logits.shape[1]
    no_top_k = top_k >= vocab_size
    k = top_k.masked_fill(no_top_k, 1)
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(no_top_k.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One categorical draw per row: argmax(p / q) with q ~ Exp(1) (the exponential race).

    Rows with their own generator draw their noise from it alone, so a seeded request samples the same
    tokens whatever else is in the batch. Modifies ``probs``."""
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    # A kernel per seeded row: the only per-request work, and only for seeded requests.
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)
