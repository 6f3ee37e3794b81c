"""Top-k expert selection from router logits, with each model family's normalisation."""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights, ids)`, both [tokens, top_k]: the `top_k` experts of highest softmax probability
    (float32, over all experts) and their weights, rescaled to sum to one when `renormalize`.

    Mixtral always renormalizes (equal to a softmax over the top-k logits); Qwen2-MoE and Qwen3-MoE
    do when their config's `norm_topk_prob` says so. Weights stay float32: the experts' outputs are
    summed in float32 before the cast back to the activation dtype."""
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {router_logits.shape[-1]}]")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
