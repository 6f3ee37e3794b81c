"""The one load loop every model and every checkpoint format goes through.

A reader (safetensors, GGUF) yields `(HF name, tensor)`; the model declares how HF names fold into its
fused parameters (`stacked_params_mapping`: `(fused module, checkpoint module, shard id)`) and which
checkpoint names carry nothing it keeps (`skip_weight_substrs`), and which parts of checkpoint names
it spells differently (`hf_name_substitutions`, applied first). Each parameter loads itself through
its `weight_loader` attribute (shard- and tensor-parallel-rank-aware, set by its layer; plain
parameters such as norms are copied whole), so this loop knows no layer type. Mixture-of-experts
models also declare `expert_params_mapping` (`(stacked parameter prefix, checkpoint name part,
expert id, shard id)`, see `pagedllm.layers.fused_moe`): each expert's projection is then loaded with
`weight_loader(param, tensor, shard_id, expert_id)` into its slice of the stacked parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader
from pagedllm.models.loader.errors import ModelLoadError

ShardId = str | int
StackedParams = Sequence[tuple[str, str, ShardId]]
ExpertParams = Sequence[tuple[str, str, int, str]]
# The part of a checkpoint name that names one expert's projection ("experts.3.gate_proj.").
_EXPERT_PART = re.compile(r"experts\.\d+\.[^.]+\.")


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


def _expert_target(
    name: str, experts: dict[str, tuple[str, int, str]]
) -> tuple[str, tuple[int, str]] | None:
    """`(stacked parameter name, (expert id, shard id))` of an expert's checkpoint tensor, else None."""
    match = _EXPERT_PART.search(name)
    if match is None or match.group(0) not in experts:
        return None
    param_prefix, expert, shard = experts[match.group(0)]
    return name.replace(match.group(0), param_prefix), (expert, shard)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named checkpoint tensors into `model`'s (fused) parameters; raise on unknown names and
    on parameters (or fused shards) the checkpoint did not provide. Returns the loaded names."""
    stacked: StackedParams = getattr(model, "stacked_params_mapping", ())
    skipped: Sequence[str] = getattr(model, "skip_weight_substrs", ())
    substitutions: dict[str, str] = getattr(model, "hf_name_substitutions", {})
    expert_params: ExpertParams = getattr(model, "expert_params_mapping", ())
    experts = {part: (prefix, expert, shard) for prefix, part, expert, shard in expert_params}
    params = dict(model.named_parameters())
    # Second names of a shared parameter (a tied LM head): loaded through its first name.
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    # A fused parameter's shard ids; an expert's shard of a stacked parameter is (expert id, shard id).
    shards_needed: dict[str, set[ShardId | tuple[int, str]]] = {}
    for fused, _, shard in stacked:
        for name in params:
            if f".{fused}." in name:
                shards_needed.setdefault(name, set()).add(shard)
    for prefix, _, expert, shard in expert_params:
        for name in params:
            if f".{prefix}" in name:
                shards_needed.setdefault(name, set()).add((expert, shard))
    shards_seen: dict[str, set[ShardId | tuple[int, str]]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        for old, new in substitutions.items():
            name = name.replace(old, new)
        if name in aliases or any(s in name for s in skipped):
            continue
        expert_target = _expert_target(name, experts) if experts else None
        if expert_target is None:
            target, shard = _target(name, stacked)
            shard_key: ShardId | tuple[int, str] | None = shard
            expert_id: tuple[int, ...] = ()
        else:
            target, shard_key = expert_target
            shard, expert_id = shard_key[1], (shard_key[0],)
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
                loader(param, tensor, shard, *expert_id)
                shards_seen.setdefault(target, set()).add(shard_key)  # type: ignore[arg-type]
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
