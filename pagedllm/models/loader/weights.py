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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pagedllm.errors import ModelLoadError
from pagedllm.layers.linear import default_weight_loader

ShardId = str | int
StackedParams = Sequence[tuple[str, str, ShardId]]
ExpertParams = Sequence[tuple[str, str, int, str]]
# A parameter's shard: a fused part's shard id, or (expert id, shard id) in a stacked expert parameter.
ShardKey = ShardId | tuple[int, str]
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


def _expert_target(name: str, experts: dict[str, tuple[str, int, str]]) -> tuple[str, tuple[int, str]] | None:
    """`(stacked parameter name, (expert id, shard id))` of an expert's checkpoint tensor, else None."""
    match = _EXPERT_PART.search(name)
    if match is None or match.group(0) not in experts:
        return None
    param_prefix, expert, shard = experts[match.group(0)]
    return name.replace(match.group(0), param_prefix), (expert, shard)


class _Targets:
    """Where each HF checkpoint name of `model` loads: its (fused) parameter and shard."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.stacked: StackedParams = getattr(model, "stacked_params_mapping", ())
        self.skipped: Sequence[str] = getattr(model, "skip_weight_substrs", ())
        self.substitutions: dict[str, str] = getattr(model, "hf_name_substitutions", {})
        expert_params: ExpertParams = getattr(model, "expert_params_mapping", ())
        self.experts = {part: (prefix, expert, shard) for prefix, part, expert, shard in expert_params}
        self.params = dict(model.named_parameters())
        # Second names of a shared parameter (a tied LM head): loaded through its first name.
        self.aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(self.params)
        # The shards each fused or stacked-expert parameter needs from a full checkpoint.
        self.shards_needed: dict[str, set[ShardKey]] = {}
        for fused, _, shard in self.stacked:
            for name in self.params:
                if f".{fused}." in name:
                    self.shards_needed.setdefault(name, set()).add(shard)
        for prefix, _, expert, expert_shard in expert_params:
            for name in self.params:
                if f".{prefix}" in name:
                    self.shards_needed.setdefault(name, set()).add((expert, expert_shard))

    def rename(self, name: str) -> str:
        """The checkpoint name as the model spells it (`hf_name_substitutions`)."""
        for old, new in self.substitutions.items():
            name = name.replace(old, new)
        return name

    def skip(self, name: str) -> bool:
        return name in self.aliases or any(s in name for s in self.skipped)

    def resolve(self, name: str) -> tuple[str, ShardKey | None, nn.Parameter]:
        expert_target = _expert_target(name, self.experts) if self.experts else None
        target, shard = expert_target or _target(name, self.stacked)
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {self.model_name}")
        return target, shard, param


def _load_one(param: nn.Parameter, target: str, tensor: torch.Tensor, shard: ShardKey | None) -> None:
    loader = getattr(param, "weight_loader", None)
    if shard is None:
        (loader or default_weight_loader)(param, tensor)
    elif loader is None:
        raise ValueError(f"parameter {target!r} takes no shards")
    elif isinstance(shard, tuple):  # one expert's projection in a stacked expert parameter
        loader(param, tensor, shard[1], shard[0])
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


def accepts(model: nn.Module) -> Callable[[str], bool]:
    """Whether `model` has a parameter (fused or not, or a tied alias) that a checkpoint tensor of
    this HF name would load into: lets a reader offer a tensor in the form the model kept for it."""
    targets = _Targets(model)

    def accept(name: str) -> bool:
        name = targets.rename(name)
        if targets.skip(name):
            return True
        try:
            targets.resolve(name)
        except ValueError:
            return False
        return True

    return accept


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
            name = targets.rename(name)
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
    shards_seen: dict[str, set[ShardKey]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        name = targets.rename(name)
        if targets.skip(name):
            continue
        try:
            target, shard, param = targets.resolve(name)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        try:
            _load_one(param, target, tensor, shard)
        except ValueError as e:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} does not fit the model its config "
                f"describes ({e})"
            ) from None
        if shard is not None:
            shards_seen.setdefault(target, set()).add(shard)
        loaded.add(target)
    if not require_all:
        return loaded
    partial = sorted(
        n for n, need in targets.shards_needed.items() if n in loaded and shards_seen.get(n) != need
    )
    missing = sorted(set(targets.params) - loaded) + partial
    if missing:
        raise ModelLoadError(_listed("checkpoint is missing weights for", missing))
    return loaded
