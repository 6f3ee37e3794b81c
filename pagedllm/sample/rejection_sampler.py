"""Verification of drafted tokens against the target model's distribution (speculative decoding).

A request verifying k drafts has k + 1 logits rows: row j is the target's distribution for the token
after its last real token and drafts d_0..d_{j-1}. Each row gets a candidate token c_j and, for the
k draft rows, an acceptance flag a_j; the request then emits d_0..d_{m-1} followed by c_m, where m is
its first rejected position (m = k when every draft is accepted: c_k is the "bonus" token).

* Greedy rows: c_j is the argmax, a_j is d_j == c_j (the longest matching prefix, so the output is
  token-for-token what decoding without drafts gives).
* ``standard`` rejection sampling (Leviathan et al. / Chen et al.) for a drafter whose proposal is a
  point mass on d_j (n-gram and suffix drafters: q(d_j) = 1): accept with probability p(d_j); on a
  rejection draw c_j from p with d_j removed and renormalized, i.e. max(p - q, 0). A drafter that
  gives its proposal probabilities ``draft_probs`` [rows, vocab] uses min(1, p(d)/q(d)) and
  max(p - q, 0) in general. Either way each emitted token is distributed exactly as p.
* ``strict``: c_j is drawn from p and the draft is accepted only when the draw equals it. Also exact
  (each emitted token is a plain draw from p), with lower acceptance than ``standard``.

Randomness per row comes from the request's own generator when it is seeded (rows of one request
draw in row order), so a seeded request reproduces whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample.ops import random_sample

REJECTION_SAMPLE_METHODS = ("standard", "strict")


@dataclass
class Verified:
    # Per request: the tokens it emits this step (accepted drafts, then one target token).
    token_ids: list[list[int]]
    # [rows] int64: the token each logits row stands for (its emitted token where one was emitted),
    # for gathering logprobs.
    row_token_ids: torch.Tensor


def _uniform(num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    u = torch.rand(num_rows, dtype=torch.float64)
    for row, generator in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    return u


def verify(
    greedy_ids: torch.Tensor | None,
    probs: torch.Tensor | None,
    greedy_rows: torch.Tensor | None,
    draft_token_ids: np.ndarray,
    cu_num_logits: np.ndarray,
    generators: dict[int, torch.Generator],
    method: str = "standard",
    draft_probs: torch.Tensor | None = None,
) -> Verified:
    """Accept or reject the drafts of every request.

    ``greedy_ids`` [rows]: the argmax of each row's processed logits (None when no row is greedy);
    ``probs`` [rows, vocab]: the target distribution of random rows after temperature and truncation
    (None when every row is greedy); ``greedy_rows`` [rows] bool (None: all greedy, or all random when
    ``probs`` is set); ``draft_token_ids`` [rows] int64: d_j on draft rows, -1 on each request's last
    row; ``cu_num_logits`` [num_reqs + 1]; ``generators``: row -> the generator of a seeded request."""
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"rejection_sample_method={method!r}; use one of {REJECTION_SAMPLE_METHODS}")
    num_rows = draft_token_ids.size
    device = (greedy_ids if greedy_ids is not None else probs).device  # type: ignore[union-attr]
    drafts = torch.from_numpy(draft_token_ids).to(device)
    is_draft = drafts >= 0
    safe_drafts = drafts.clamp(min=0).unsqueeze(1)
    candidates = accept = None
    if greedy_ids is not None:
        candidates = greedy_ids
        accept = candidates == drafts
    if probs is not None:
        if method == "strict":
            sampled = random_sample(probs.clone(), generators)
            sampled_accept = sampled == drafts
        else:
            p_draft = probs.gather(1, safe_drafts).squeeze(1)
            q_draft = (
                torch.ones_like(p_draft)
                if draft_probs is None
                else draft_probs.gather(1, safe_drafts).squeeze(1)
            )
            u = _uniform(num_rows, generators).to(probs.device)
            # Accept with probability min(1, p/q): u * q < p.
            sampled_accept = (u * q_draft.double() < p_draft.double()) & is_draft
            residual = probs.clone()
            if draft_probs is None:
                residual.scatter_(1, safe_drafts, torch.where(is_draft, 0.0, p_draft).unsqueeze(1))
            else:
                adjusted = (probs - draft_probs).clamp_(min=0)
                residual = torch.where(is_draft.unsqueeze(1), adjusted, residual)
            sampled = random_sample(residual, generators)
        if greedy_rows is None:
            candidates, accept = sampled, sampled_accept
        else:
            assert candidates is not None and accept is not None
            candidates = torch.where(greedy_rows, candidates, sampled)
            accept = torch.where(greedy_rows, accept, sampled_accept)
    assert candidates is not None and accept is not None
    accept &= is_draft
    cand = candidates.tolist()
    acc = accept.tolist()
    token_ids: list[list[int]] = []
    row_tokens = draft_token_ids.copy()
    for i in range(cu_num_logits.size - 1):
        start, end = int(cu_num_logits[i]), int(cu_num_logits[i + 1])
        m = start
        while m < end - 1 and acc[m]:
            m += 1
        row_tokens[m] = cand[m]
        token_ids.append([*draft_token_ids[start:m].tolist(), cand[m]])
    return Verified(token_ids, torch.from_numpy(row_tokens).clamp_(min=0))
