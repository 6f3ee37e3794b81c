"""GraphKey: how a feature that changes a decoder block's traced code says so.

The compiled forward (`pagedllm.worker.compiled_forward`) traces one decoder block per shape class
and runs that graph for every layer with Dynamo's guards skipped, so nothing at run time would notice
a layer, or a step, that traces different code. So every feature that puts state the traced code reads
on a block's modules (an attention implementation, a quantization method, a LoRA wrapper) or changes
it from step to step (LoRA: whether adapters run) is a `GraphKeyContributor`, registered with the
compiled forward: each graph is keyed by every contributor's `graph_key(block)` and
`step_graph_key()`, and a block holding an object that no contributor `owns` is refused at start-up
(`GraphKeyError`). A feature that forgot its key is an error, never a graph of other code run silently.

What a block's modules hold beside tensors, submodules and plain values (numbers, strings, dtypes and
sequences or dicts of them, which the architecture fixes for all layers) is such an object.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from typing import Protocol

import torch
from torch import nn

_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)
# What every nn.Module keeps in its __dict__ (parameters, buffers, submodules, hooks, training).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


class GraphKeyError(RuntimeError):
    """A block holds state its traced code may read that no graph key covers."""


class GraphKeyContributor(Protocol):
    def owns(self, obj: object) -> bool:
        """Whether `obj`, found on a module of a traced block, is this feature's: its keys cover what
        the traced code reads of it."""
        ...

    def graph_key(self, block: nn.Module) -> Hashable:
        """What this feature bakes into `block`'s traced code (fixed once the model is loaded)."""
        ...

    def step_graph_key(self) -> Hashable:
        """What it changes in the traced code from step to step (None: nothing)."""
        ...


def _is_plain(value: object) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple, frozenset)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return False


def unowned_objects(block: nn.Module, contributors: Sequence[GraphKeyContributor]) -> list[str]:
    """`module.attribute (type)` of every object on `block`'s modules that no contributor owns."""
    found = []
    for name, module in block.named_modules():
        for attr, value in vars(module).items():
            if attr in _MODULE_INTERNALS or isinstance(value, (torch.Tensor, nn.Module)) or _is_plain(value):
                continue
            if not any(c.owns(value) for c in contributors):
                kind = value.__name__ if isinstance(value, type) else type(value).__name__
                found.append(f"{name + '.' if name else ''}{attr} ({kind})")
    return found


def check_owned(blocks: Sequence[nn.Module], contributors: Sequence[GraphKeyContributor]) -> None:
    """Raise `GraphKeyError` naming what no contributor owns in any of `blocks`."""
    for i, block in enumerate(blocks):
        unowned = unowned_objects(block, contributors)
        if unowned:
            raise GraphKeyError(
                f"decoder block {i} ({type(block).__name__}) holds {', '.join(unowned)}, which no graph-key "
                "contributor covers: a compiled graph keyed without it could run another layer's or step's "
                "code. Register the feature as a GraphKeyContributor (pagedllm.layers.graph_key), or run "
                "eagerly (enforce_eager)."
            )
