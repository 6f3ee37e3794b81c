"""The experts of a mixture-of-experts layer applied to a flattened batch, grouped by expert.

Every (token, chosen expert) pair is sorted by expert id, so each expert that has tokens this step
runs one gate/up GEMM, the SiLU-and-multiply and one down GEMM over all of its rows: its weights are
read once per step whatever the number of tokens routed to it (a per-token loop would read them once
per token). Experts no token chose are skipped. The weighted outputs are summed back per token in
float32.

Against `torch._grouped_mm` (which only recent torch builds have on the CPU) neither wins by enough to
keep two paths (figures: benchmarks/RESULTS.md, "Figures behind code choices"), so the portable loop
is the one path. There is no native
kernel yet: with a few rows per expert the GEMMs run far below the CPU's peak (per-call overhead), so
one that walks the grouped rows of every expert in a single call may pay; it has not been measured.

The function is registered as the opaque op `torch.ops.pagedllm.fused_experts`: its grouping is
data-dependent (the expert counts are read on the host), so torch.compile keeps it out of the traced
decoder block, which then stays one graph, as with attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` with `e = topk_ids[t, j]`,
    for `hidden_states` [T, H], `w13` [E, 2I, H] (gate rows then up rows), `w2` [E, H, I]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter2, _ = w13.shape
    inter = inter2 // 2
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // top_k
    rows = hidden_states.index_select(0, token_of)  # [T*k, H], grouped by expert
    out_rows = torch.empty(rows.shape[0], w2.shape[1], dtype=torch.float32, device=rows.device)
    gate_up = torch.empty(rows.shape[0], inter2, dtype=rows.dtype, device=rows.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = torch.mm(rows[start:end], w13[expert].t(), out=gate_up[start:end])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out_rows[start:end] = torch.mm(act, w2[expert].t())
        start = end
    out_rows *= topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, token_of, out_rows)
    return out.to(hidden_states.dtype)


def _fused_experts_fake(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape[0], w2.shape[1])


# A fragment of the "pagedllm" namespace (attention defines the namespace itself).
_LIBRARY = torch.library.Library("pagedllm", "FRAGMENT")
_LIBRARY.define(
    "fused_experts(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor"
)
_LIBRARY.impl("fused_experts", fused_experts, "CompositeExplicitAutograd")
torch.library.register_fake("pagedllm::fused_experts", _fused_experts_fake, lib=_LIBRARY)
