"""The mixture-of-experts layer: routing equal to transformers' routers, the grouped expert product
equal to a per-token loop, the stacked weights filled from per-expert checkpoint tensors, and the op
traced by torch.compile as one opaque node."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from pagedllm.distributed import parallel_state
from pagedllm.layers.fused_moe import FusedMoE, fused_experts, make_expert_params_mapping, select_experts
from pagedllm.models import ModelLoadError
from pagedllm.models.loader.weights import load_weights

E, H, INTER = 8, 32, 24


def _reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """One token and one chosen expert at a time."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up)).float()
    return out.to(x.dtype)


def _uneven_ids(tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """Distinct experts per token, drawn with skewed odds: expert 0 in most tokens, 7 in none."""
    odds = torch.tensor([16.0, 8, 4, 2, 1, 1, 1, 0])
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(odds, top_k, generator=gen) for _ in range(tokens)])


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (5, 3), (37, 4)])
def test_fused_experts_equals_per_token_loop(tokens: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.2
    ids = _uneven_ids(tokens, top_k, tokens)
    weights = torch.rand(tokens, top_k, generator=gen)
    got = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, _reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert got.shape == (tokens, H) and got.dtype == torch.float32


def test_fused_experts_bfloat16() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(19, H, generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.2).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=gen) * 0.2).bfloat16()
    ids = _uneven_ids(19, 3, 3)
    weights = torch.rand(19, 3, generator=gen)
    got = fused_experts(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    ref = _reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), ref, atol=0.03 * ref.abs().max().item(), rtol=0)


def _qwen3_moe_config(top_k: int, norm_topk_prob: bool) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=H, num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob
    )


def test_routing_equals_transformers() -> None:
    """Mixtral renormalizes the top-k probabilities; Qwen-MoE does when `norm_topk_prob`."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, H, generator=gen)
    for router, renormalize in (
        (MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=3)), True),
        (Qwen3MoeTopKRouter(_qwen3_moe_config(top_k=4, norm_topk_prob=True)), True),
        (Qwen3MoeTopKRouter(_qwen3_moe_config(top_k=2, norm_topk_prob=False)), False),
    ):
        with torch.no_grad():
            router.weight.copy_(torch.randn(E, H, generator=gen))
            logits, ref_weights, ref_ids = router(hidden)
        weights, ids = select_experts(logits, router.top_k, renormalize)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights.float())
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        select_experts(logits, E + 1, False)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = FusedMoE(E, 2, H, INTER, renormalize=True, prefix="mlp.experts")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _Block()
        self.expert_params_mapping = make_expert_params_mapping("w1", "w2", "w3", E)


def _expert_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(E):
        for name, shape in (("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER))):
            tensors[f"mlp.experts.{e}.{name}.weight"] = torch.randn(shape, generator=gen)
    return tensors


def test_expert_tensors_fill_the_stacked_weights() -> None:
    model = _Model()
    tensors = _expert_tensors(0)
    load_weights(model, tensors.items())
    layer = model.mlp.experts
    for e in range(E):
        assert torch.equal(layer.w13_weight[e, :INTER], tensors[f"mlp.experts.{e}.w1.weight"])
        assert torch.equal(layer.w13_weight[e, INTER:], tensors[f"mlp.experts.{e}.w3.weight"])
        assert torch.equal(layer.w2_weight[e], tensors[f"mlp.experts.{e}.w2.weight"])
    # The layer applies the experts it loaded: equal to the per-token loop on the same tensors.
    x = torch.randn(6, H)
    logits = torch.randn(6, E)
    weights, ids = select_experts(logits, 2, True)
    with torch.no_grad():
        got = layer(x, logits)
    ref = _reference(x, layer.w13_weight, layer.w2_weight, weights, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_missing_expert_and_bad_shapes_are_refused() -> None:
    tensors = _expert_tensors(1)
    del tensors["mlp.experts.5.w3.weight"]
    with pytest.raises(ModelLoadError, match="missing weights for: mlp.experts.w13_weight"):
        load_weights(_Model(), tensors.items())
    tensors = _expert_tensors(1)
    tensors["mlp.experts.2.w2.weight"] = torch.zeros(INTER, H)
    with pytest.raises(ModelLoadError, match="mlp.experts.2.w2.weight"):
        load_weights(_Model(), tensors.items())
    layer = _Model().mlp.experts
    with pytest.raises(ValueError, match="unknown expert shard id"):
        layer.weight_loader(layer.w2_weight, torch.zeros(H, INTER), "w4", 0)
    with pytest.raises(ValueError, match="expert 8 out of range"):
        layer.weight_loader(layer.w2_weight, torch.zeros(H, INTER), "w2", E)


def test_tensor_parallel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="not sharded across tensor-parallel ranks"):
        FusedMoE(E, 2, H, INTER, renormalize=True)


def test_compiles_as_one_graph_with_an_opaque_op() -> None:
    """The data-dependent grouping stays inside the op: a dynamic token count traces with no graph
    break, and the compiled layer gives the eager result."""
    layer = _Model().mlp.experts
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=True)
        for tokens in (3, 9):
            x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
            torch.testing.assert_close(compiled(x, logits), layer(x, logits))
