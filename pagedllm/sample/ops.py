"""Batched logit transforms and the random draw, a few tensor ops per step for the whole batch.

Order (vLLM V1): logit bias, penalties and bans act on the raw logits; then temperature; then min-p,
top-k and top-p truncate the distribution; then one draw per random row.
All functions work in place on ``logits`` [num_reqs, vocab] float32 and return it.

Two kernels have a CPU variant, chosen by the tensor's device, because what is cheap on a GPU is not
on a CPU: the exponential race needs a random number per vocabulary entry, while inverse-CDF sampling
needs one per row; and a full sort for top-p is far slower than a top-256 partial sort, which finds the
cut-off of almost every row (the rest fall back to the sort). Figures: benchmarks/RESULTS.md, "Figures
behind code choices". On CUDA both stay vLLM's sync-free kernels.
"""

from __future__ import annotations

import torch

# Candidate set sizes the CPU top-p tries, in order, before a full sort of the row.
_TOP_P_CANDIDATES = (256, 4096)


def apply_penalties(
    logits: torch.Tensor,
    seen: tuple[torch.Tensor, torch.Tensor] | None,
    output: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's arithmetic, on the (row, token) entries concerned only instead of the whole vocabulary.

    ``seen``: unique (rows, token ids) of the prompt and output of rows with a repetition penalty, which
    divides positive / multiplies negative logits. ``output``: unique (rows, token ids, counts) of the
    outputs, for the frequency (times count) and presence (once) penalties of the OpenAI API."""
    if seen is not None:
        rows, ids = seen
        values = logits[rows, ids]
        penalty = repetition_penalties[rows]
        logits[rows, ids] = values * torch.where(values > 0, 1.0 / penalty, penalty)
    if output is not None:
        rows, ids, counts = output
        values = logits[rows, ids] - frequency_penalties[rows] * counts
        logits[rows, ids] = values - presence_penalties[rows]
    return logits


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
    ``max_top_k`` (the largest top_k in use, a host int) lets top-k skip the full sort without reading
    it back from the device."""
    if top_k is not None and max_top_k is None:
        max_top_k = int(top_k.masked_fill(top_k >= logits.shape[1], 1).max())
    if top_p is None:
        if top_k is None:
            return logits
        assert max_top_k is not None
        return _apply_top_k_only(logits, top_k, max_top_k)
    if logits.device.type == "cpu":
        return apply_top_p_partial(logits, top_k, top_p, max_top_k or 0)
    return apply_top_k_top_p_sorted(logits, top_k, top_p)


def apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """vLLM's kernel: one ascending sort, the k-th value as a threshold, then drop the low tail whose
    total mass stays within 1 - p (the largest token always survives)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)


def apply_top_p_partial(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, max_top_k: int
) -> torch.Tensor:
    """The same cut-offs from the top candidates only: token j (in descending order) is kept iff the
    mass strictly above it is below p. Rows whose cut-off lies beyond the candidates try a larger
    candidate set, and finally the sorted kernel. The cut-offs equal the sorted kernel's up to float32
    rounding of the cumulative mass right at the boundary (both round, in different orders)."""
    vocab_size = logits.shape[1]
    tiers = sorted({min(vocab_size, max(n, max_top_k)) for n in _TOP_P_CANDIDATES})
    values = logits.topk(tiers[0], dim=-1).values
    if top_k is not None:
        kth = values.gather(1, (top_k.clamp(max=tiers[0]) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), float("-inf"))
        logits.masked_fill_(logits < kth, float("-inf"))
        values.masked_fill_(values < kth, float("-inf"))
    log_total = logits.logsumexp(dim=-1, keepdim=True)
    threshold = torch.full_like(log_total, float("-inf"))
    # Rows with top_p 1 keep everything (threshold -inf) and need no search.
    pending = (top_p < 1.0).nonzero().squeeze(1)
    to_sort = []
    for tier, num_candidates in enumerate(tiers):
        if pending.numel() == 0:
            break
        values = values[pending] if tier == 0 else logits[pending].topk(num_candidates, dim=-1).values
        p = top_p[pending]
        probs = (values - log_total[pending]).exp()
        mass_above = probs.cumsum(dim=-1) - probs
        num_kept = (mass_above < p.unsqueeze(1)).sum(dim=-1, keepdim=True)
        # The cut-off may lie beyond the candidates only if all are kept and more tokens remain.
        beyond = (num_kept.squeeze(1) == num_candidates) & (values[:, -1] > float("-inf"))
        if num_candidates == vocab_size:
            beyond.zero_()
        done = ~beyond
        threshold[pending[done]] = values[done].gather(1, num_kept[done] - 1)
        if tier + 1 < len(tiers):
            # No later token is likelier than the last candidate, so reaching p takes at least `need`
            # tokens: rows that cannot fit the next tier go straight to the sort.
            last = probs[:, -1]
            need = num_candidates + (p - mass_above[:, -1] - last) / last
            hopeless = beyond & (need > tiers[tier + 1])
            to_sort.append(pending[hopeless])
            beyond &= ~hopeless
        pending = pending[beyond]
    to_sort.append(pending)
    rows = torch.cat(to_sort)
    if rows.numel():
        logits[rows] = apply_top_k_top_p_sorted(logits[rows], None, top_p[rows])
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """top-k without a full sort: one topk of the batch's largest k, then a threshold per row."""
    vocab_size = logits.shape[1]
    no_top_k = top_k >= vocab_size
    k = top_k.masked_fill(no_top_k, 1)
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(no_top_k.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One categorical draw per row; rows with their own generator draw their randomness from it alone,
    so a seeded request samples the same tokens whatever else is in the batch. Modifies ``probs``.

    CUDA: the exponential race argmax(p / q), q ~ Exp(1) (no device sync). CPU: inverse CDF, one
    uniform per row against the row's float64 cumulative sum (same distribution, see the module doc)."""
    if probs.device.type == "cpu":
        return inverse_cdf_sample(probs, generators)
    return exponential_race(probs, generators)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    # A kernel per seeded row: the only per-request work, and only for seeded requests.
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64)
    for row, generator in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    # The first index whose cumulative mass exceeds u * total: zero-probability tokens (a flat step of
    # the CDF) are never picked, and capping below the total keeps the index in range.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row without any allowed token (NaN) must still yield an id inside the vocabulary.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
