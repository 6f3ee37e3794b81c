"""The one load loop every model and every checkpoint format goes through.

A reader (safetensors, GGUF) yields `(HF name, tensor)`; the model declares how HF names fold into its
fused parameters (`stacked_params_mapping`: `(fused module, checkpoint module, shard id)`) and which
checkpoint names carry nothing it keeps (`skip_weight_substrs`). Each parameter loads itself through
its `weight_loader` attribute (shard- and tensor-parallel-rank-aware, set by its layer; plain
parameters such as norms are copied whole), so this loop knows no layer type.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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


class _Targets:
    """Where each HF checkpoint name of `model` loads: its (fused) parameter and shard."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.stacked: StackedParams = getattr(model, "stacked_params_mapping", ())
        self.skipped: Sequence[str] = getattr(model, "skip_weight_substrs", ())
        self.params = dict(model.named_parameters())
        # Second names of a shared parameter (a tied LM head): loaded through its first name.
        self.aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(self.params)

    def skip(self, name: str) -> bool:
        return name in self.aliases or any(s in name for s in self.skipped)

    def resolve(self, name: str) -> tuple[str, ShardId | None, nn.Parameter]:
        target, shard = _target(name, self.stacked)
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {self.model_name}")
        return target, shard, param


def _load_one(param: nn.Parameter, target: str, tensor: torch.Tensor, shard: ShardId | None) -> None:
    loader = getattr(param, "weight_loader", None)
    if shard is None:
        (loader or default_weight_loader)(param, tensor)
    elif loader is None:
        raise ValueError(f"parameter {target!r} takes no shards")
    else:
        loader(param, tensor, shard)


class _DryRunCopies(TorchFunctionMode):
    """Turns `copy_` into a shape check that copies nothing (and never broadcasts): a parameter's own
    `weight_loader` then validates a (meta) tensor against the real parameter without writing to it."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_:
            if args[0].shape != args[1].shape:
                raise ValueError(f"weight shape {tuple(args[1].shape)} does not match {tuple(args[0].shape)}")
            return args[0]
        return func(*args, **(kwargs or {}))


def _listed(what: str, names: Sequence[str]) -> str:
    return f"{what}: {', '.join(names[:10])}" + (f" (and {len(names) - 10} more)" if len(names) > 10 else "")


def check_weights(model: nn.Module, specs: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
    """Raise ModelLoadError naming every `(HF name, shape, dtype)` that `load_weights` would refuse,
    without writing to the model: each goes through its parameter's own `weight_loader`, on a meta
    tensor, with copies turned into shape checks.

    Why: a weight update must be refused whole, before any of it is applied."""
    targets = _Targets(model)
    problems: list[str] = []
    with _DryRunCopies():
        for name, shape, dtype in specs:
            if targets.skip(name):
                continue
            try:
                target, shard, param = targets.resolve(name)
                if dtype.is_floating_point != param.dtype.is_floating_point:
                    raise ValueError(f"dtype {dtype} cannot load into {param.dtype}")
                _load_one(param, target, torch.empty(tuple(shape), dtype=dtype, device="meta"), shard)
            except (ValueError, RuntimeError) as e:
                problems.append(f"{name!r}: {e}")
    if problems:
        raise ModelLoadError(_listed(f"{len(problems)} weight(s) refused, nothing was loaded", problems))


def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], require_all: bool = True
) -> set[str]:
    """Copy HF-named checkpoint tensors into `model`'s (fused) parameters; raise on unknown names and
    (with `require_all`, as for a full checkpoint; not for a weight update) on parameters (or fused
    shards) the checkpoint did not provide. Returns the loaded names."""
    targets = _Targets(model)
    shards_needed: dict[str, set[ShardId]] = {}
    for fused, _, shard in targets.stacked:
        for name in targets.params:
            if f".{fused}." in name:
                shards_needed.setdefault(name, set()).add(shard)
    shards_seen: dict[str, set[ShardId]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if targets.skip(name):
            continue
        try:
            target, shard, param = targets.resolve(name)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        try:
            _load_one(param, target, tensor, shard)
        except ValueError as e:
            raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
        if shard is not None:
            shards_seen.setdefault(target, set()).add(shard)
        loaded.add(target)
    if not require_all:
        return loaded
    partial = sorted(n for n, need in shards_needed.items() if n in loaded and shards_seen.get(n) != need)
    missing = sorted(set(targets.params) - loaded) + partial
    if missing:
        raise ModelLoadError(_listed("checkpoint is missing weights for", missing))
    return loaded
