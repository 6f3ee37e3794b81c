"""`check_weights`: a dry run of `load_weights` through each parameter's own weight loader, which
accepts exactly what loading accepts and writes nothing; and partial loads for weight updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import make_tiny_model

from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.loader.weights import check_weights, load_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    # Qwen2: fused q/k/v with biases (1-D shards), fused gate/up, an untied LM head.
    path = tmp_path_factory.mktemp("weights")
    hf = make_tiny_model("qwen2-bias", path)
    model = load_model(hf.config, Path(path))
    return model, load_file(str(path / "model.safetensors"))


def _specs(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def test_checkpoint_accepted_and_nothing_written(checkpoint: tuple[torch.nn.Module, dict]) -> None:
    model, tensors = checkpoint
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    check_weights(model, _specs(tensors))
    # bf16 into float32 parameters loads (cast by the copy) and so passes.
    check_weights(model, [(n, s, torch.bfloat16) for n, s, _ in _specs(tensors)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    ("name", "shape", "error"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (63, 64), "does not match"),
        # A shard of a fused parameter: checked by the fused layer's own loader.
        ("model.layers.0.self_attn.k_proj.bias", (1,), "does not match"),
        ("model.layers.0.mlp.up_proj.weight", (128, 1), "does not match"),
        ("model.norm.weight", (65,), "does not match"),
        ("model.layers.9.mlp.up_proj.weight", (128, 64), "no matching parameter"),
    ],
)
def test_wrong_name_or_shape_refused_whole(
    checkpoint: tuple[torch.nn.Module, dict], name: str, shape: tuple[int, ...], error: str
) -> None:
    model, tensors = checkpoint
    specs = [*_specs(tensors), (name, shape, torch.float32)]
    with pytest.raises(
        ModelLoadError, match=f"1 weight\\(s\\) refused, nothing was loaded: '{name}': .*{error}"
    ):
        check_weights(model, specs)


def test_integer_tensor_refused(checkpoint: tuple[torch.nn.Module, dict]) -> None:
    model, _ = checkpoint
    with pytest.raises(ModelLoadError, match="dtype torch.int64 cannot load into torch.float32"):
        check_weights(model, [("model.norm.weight", (64,), torch.int64)])


def test_partial_load_for_updates(checkpoint: tuple[torch.nn.Module, dict]) -> None:
    model, tensors = checkpoint
    norm = dict(model.named_parameters())["model.norm.weight"]
    original = norm.detach().clone()
    with pytest.raises(ModelLoadError, match="checkpoint is missing weights"):
        load_weights(model, [("model.norm.weight", original + 1)])
    assert load_weights(model, [("model.norm.weight", original + 2)], require_all=False) == {
        "model.norm.weight"
    }
    assert torch.equal(norm, original + 2)
    load_weights(model, tensors.items())
