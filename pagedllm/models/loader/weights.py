"""The one load loop every model and every checkpoint format goes through.

A reader (safetensors, GGUF) yields `(HF name, tensor)`; the model declares how HF names fold into its
fused parameters (`stacked_params_mapping`: `(fused module, checkpoint module, shard id)`) and which
checkpoint names carry nothing it keeps (`skip_weight_substrs`). Each parameter loads itself through
its `weight_loader` attribute (shard- and tensor-parallel-rank-aware, set by its layer; plain
parameters such as norms are copied whole), so this loop knows no layer type.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader
from pagedllm.models.loader.errors import ModelLoadError

ShardId = str | int
StackedParams = Sequence[tuple[str, str, ShardId]]


def packed_modules(stacked: StackedParams) -> dict[str, list[str]]:
    """`{fused module: [checkpoint modules, in shard order]}` (vLLM's `packed_modules_mapping`, which
    quantization and LoRA configs use to name the parts of a fused layer)."""
    packed: dict[str, list[str]] = {}
    for fused, part, _ in stacked:
        packed.setdefault(fused, []).append(part)
    return packed


def _target(name: str, stacked: StackedParams) -> tuple[str, ShardId | None]:
    for fused, part, shard in stacked:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named checkpoint tensors into `model`'s (fused) parameters; raise on unknown names and
    on parameters (or fused shards) the checkpoint did not provide. Returns the loaded names."""
    stacked: StackedParams = getattr(model, "stacked_params_mapping", ())
    skipped: Sequence[str] = getattr(model, "skip_weight_substrs", ())
    params = dict(model.named_parameters())
    # Second names of a shared parameter (a tied LM head): loaded through its first name.
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    shards_needed: dict[str, set[ShardId]] = {}
    for fused, _, shard in stacked:
        for name in params:
            if f".{fused}." in name:
                shards_needed.setdefault(name, set()).add(shard)
    shards_seen: dict[str, set[ShardId]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in aliases or any(s in name for s in skipped):
            continue
        target, shard = _target(name, stacked)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", None)
        try:
            if shard is None:
                (loader or default_weight_loader)(param, tensor)
            elif loader is None:
                raise ValueError(f"parameter {target!r} takes no shards")
            else:
                loader(param, tensor, shard)
                shards_seen.setdefault(target, set()).add(shard)
        except ValueError as e:
            raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.add(target)
    partial = sorted(n for n, need in shards_needed.items() if n in loaded and shards_seen.get(n) != need)
    missing = sorted(set(params) - loaded) + partial
    if missing:
        raise ModelLoadError(
            f"checkpoint is missing weights for: {', '.join(missing[:10])}"
            + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else "")
        )
    return loaded
