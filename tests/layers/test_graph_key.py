"""GraphKey contributions: a compiled block's graph is keyed by every registered feature, and a feature
that changes the traced code without contributing a key is refused when the forward is built (an
error, never another layer's graph run silently)."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_llm import make_tiny_llm
from torch import nn

from pagedllm.attention import AttentionGraphKey
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.forward_context import set_forward_context
from pagedllm.layers.graph_key import GraphKeyError, check_owned, unowned_objects
from pagedllm.layers.quant import QuantGraphKey
from pagedllm.models.llama import LlamaMLP
from pagedllm.worker.compiled_forward import CompiledForward
from pagedllm.worker.model_runner import ModelRunner


class _Scale:
    """A fake feature's state on an MLP: its output is scaled (the traced code bakes the factor in)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor


class _ScaleGraphKey:
    def owns(self, obj: object) -> bool:
        return isinstance(obj, _Scale)

    def graph_key(self, block: nn.Module) -> Hashable:
        scale = getattr(getattr(block, "mlp", None), "scale", None)
        return None if scale is None else scale.factor

    def step_graph_key(self) -> Hashable:
        return None


def _scaled_mlp_forward(self: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    out = self.down_proj(self.act_fn(self.gate_up_proj(x)))
    scale = getattr(self, "scale", None)
    return out if scale is None else out * scale.factor


def test_unowned_objects_are_named() -> None:
    block = nn.Sequential(nn.Linear(2, 2))
    block.plain = (1, 2.0, "x", torch.float32)  # type: ignore[assignment]
    block[0].scale = _Scale(2.0)  # type: ignore[assignment]
    assert unowned_objects(block, []) == ["0.scale (_Scale)"]
    assert unowned_objects(block, [_ScaleGraphKey()]) == []
    with pytest.raises(GraphKeyError, match=r"decoder block 0 \(Sequential\) holds 0.scale \(_Scale\)"):
        check_owned([block], [])


def _config(model_dir: Path, optimization_level: int) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=128),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        cache_config=CacheConfig(block_size=16),
        optimization_level=optimization_level,
    )


@pytest.fixture(scope="module")
def eager_runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    runner = ModelRunner(_config(make_tiny_llm(tmp_path_factory.mktemp("llama")), optimization_level=0))
    runner.load_model()
    return runner


def _compiled_config(runner: ModelRunner, tmp_path: Path) -> EngineConfig:
    config = _config(Path(runner.model_config.model), optimization_level=2)
    config.compilation_config.cache_dir = str(tmp_path / "compile-cache")
    return config


def _hidden(forward: Any, n: int = 5) -> torch.Tensor:
    with torch.inference_mode(), set_forward_context(None):
        return forward(torch.arange(3, 3 + n), torch.arange(n))


def test_a_feature_without_a_key_is_refused_and_with_one_compiles_right(
    eager_runner: ModelRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = eager_runner._require_model()
    monkeypatch.setattr(LlamaMLP, "forward", _scaled_mlp_forward)
    # The feature scales the second layer's MLP only: one graph for both layers would run one factor.
    monkeypatch.setattr(model.model.layers[1].mlp, "scale", _Scale(3.0), raising=False)
    want = _hidden(model)
    config = _compiled_config(eager_runner, tmp_path)
    base = [AttentionGraphKey(), QuantGraphKey()]
    with pytest.raises(GraphKeyError, match=r"decoder block 1 .* holds mlp.scale \(_Scale\)"):
        CompiledForward(model, config, base)
    try:
        keyed = CompiledForward(model, config, [*base, _ScaleGraphKey()])
        torch.testing.assert_close(_hidden(keyed), want, rtol=1e-4, atol=1e-4)
    finally:
        _uncompile(model)


def _uncompile(model: nn.Module) -> None:
    """Undo what CompiledForward patched in place: the blocks' forward and the LM head."""
    for block in model.model.layers:
        block.__dict__.pop("forward", None)
    model.__dict__.pop("compute_logits", None)
