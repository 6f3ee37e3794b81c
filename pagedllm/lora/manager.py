"""The worker's adapters: which are in memory (an LRU of `max_cpu_loras`), which sit in the layers'
`max_loras` slots, and which slot each batch row's tokens use this step.

An adapter is read once (`add_adapter`, which also checks it against the model's shapes and
`max_lora_rank`) into CPU memory, already split into the slices of the model's fused layers; a request
that needs it puts it in a free slot (copying into each layer's stacked buffers) unless it is there
already. A slot stays filled after its last request finishes, so a returning adapter costs nothing; it
is overwritten only when another adapter needs a slot and it has no request in the batch. The
scheduler admits at most `max_loras` adapters at once, so a free slot always exists.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pagedllm.layers.linear import ColumnParallelLinear, LinearBase
from pagedllm.lora.allowed_roots import check_adapter_path
from pagedllm.lora.layers import LoRABatchState, LoRALinearMethod
from pagedllm.lora.peft_loader import SUPPORTED_TARGETS, LoRAAdapterError, load_peft_adapter
from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedllm.config.lora import LoRAConfig

logger = logging.getLogger("pagedllm.lora")

# Per wrapped layer: per output slice, (A, B) or None.
SlotWeights = dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lora_dtype(lora_config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if lora_config.lora_dtype == "auto" else _DTYPES[lora_config.lora_dtype]


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        max_num_tokens: int,
        max_num_reqs: int,
        model_dtype: torch.dtype,
    ) -> None:
        self.max_loras: int = lora_config.max_loras
        self.max_cpu_loras: int = lora_config.max_cpu_loras or lora_config.max_loras
        self.max_rank: int = lora_config.max_lora_rank
        self.allowed_roots: list[str] | None = lora_config.lora_allowed_roots
        self.dtype = lora_dtype(lora_config, model_dtype)
        device = next(model.parameters()).device
        self.state = LoRABatchState(max_num_tokens, self.max_loras, self.dtype, device)
        self.packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}))
        self.substitutions: dict[str, str] = dict(getattr(model, "hf_name_substitutions", {}))
        targets = set(SUPPORTED_TARGETS) | set(self.packed)
        self.layers: dict[str, tuple[LinearBase, LoRALinearMethod]] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and name.rsplit(".", 1)[-1] in targets:
                sizes = (
                    module.output_sizes if isinstance(module, ColumnParallelLinear) else [module.output_size]
                )
                method = LoRALinearMethod(module.quant_method, module, sizes, self.state, self.max_rank)
                module.quant_method = method
                self.layers[name] = (module, method)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no projections LoRA adapters can target")
        # lora_int_id -> (request, weights per layer), least recently used first.
        self.cpu_cache: OrderedDict[int, tuple[LoRARequest, SlotWeights]] = OrderedDict()
        self.slot_lora = [0] * self.max_loras  # lora_int_id in each slot (0: empty)
        self.slot_refs = np.zeros(self.max_loras, dtype=np.int64)  # batch rows using each slot
        self.slot_used = [0] * self.max_loras  # last use, for picking a slot to overwrite
        self._clock = 0
        self.row_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        logger.info(
            "LoRA: %d projections wrapped, %d slots of rank %d (%s)",
            len(self.layers),
            self.max_loras,
            self.max_rank,
            self.dtype,
        )

    # ------------------------------------------------------------------------------- adapters
    def _resolve(self, module: str) -> tuple[str, int | None]:
        """The wrapped layer an adapter's HF module name lands in, and its slice (None: all of it)."""
        for old, new in self.substitutions.items():
            module = module.replace(old, new)
        if module in self.layers:
            return module, None
        parent, _, leaf = module.rpartition(".")
        for fused, parts in self.packed.items():
            if leaf in parts and f"{parent}.{fused}" in self.layers:
                return f"{parent}.{fused}", parts.index(leaf)
        raise LoRAAdapterError(f"the adapter targets {module!r}, which is not a projection of this model")

    def _load(self, request: LoRARequest) -> SlotWeights:
        adapter = load_peft_adapter(check_adapter_path(request.lora_path, self.allowed_roots), self.dtype)
        name = request.lora_name
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} has rank {adapter.rank}, above max_lora_rank={self.max_rank} "
                "(raise --max-lora-rank)"
            )
        weights: SlotWeights = {}
        for module, w in adapter.modules.items():
            layer_name, index = self._resolve(module)
            layer, method = self.layers[layer_name]
            sizes = method.slice_sizes
            in_size = layer.input_size_per_partition
            wanted_out = sum(sizes) if index is None else sizes[index]
            if w.a.shape[1] != in_size or w.b.shape[0] != wanted_out:
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r} does not match the base model: {module} has lora_A "
                    f"{tuple(w.a.shape)} and lora_B {tuple(w.b.shape)}, the model's projection takes "
                    f"{in_size} inputs to {wanted_out} outputs"
                )
            slices = weights.setdefault(layer_name, [None] * len(sizes))
            if index is not None:
                slices[index] = (w.a, w.b)
                continue
            for i, part in enumerate(torch.split(w.b, sizes, dim=0)):
                slices[i] = (w.a, part)
        return weights

    def add_adapter(self, request: LoRARequest) -> bool:
        """Read and check the adapter into CPU memory (LRU); False if it was there already."""
        if request.lora_int_id in self.cpu_cache:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return False
        weights = self._load(request)
        while len(self.cpu_cache) >= self.max_cpu_loras:
            # Least recently used first, preferring one not in a slot (a slotted one keeps serving from
            # its slot either way).
            slotted = set(self.slot_lora)
            victim = next((i for i in self.cpu_cache if i not in slotted), next(iter(self.cpu_cache)))
            del self.cpu_cache[victim]
            logger.info("LoRA adapter %d evicted from memory (max_cpu_loras=%d)", victim, self.max_cpu_loras)
        self.cpu_cache[request.lora_int_id] = (request, weights)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget the adapter (memory and slot). The engine refuses this while an unfinished request
        uses it; a finished request's row may still count here until the next step drops it, which
        frees the slot before any new request of that step takes one."""
        if lora_int_id in self.slot_lora:
            self.slot_lora[self.slot_lora.index(lora_int_id)] = 0
        return self.cpu_cache.pop(lora_int_id, None) is not None

    def list_adapters(self) -> list[int]:
        return list(self.cpu_cache)

    # ------------------------------------------------------------------------------- batch rows
    def _slot_for(self, request: LoRARequest) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slot_lora:
            return self.slot_lora.index(lora_id)
        free = [s for s in range(self.max_loras) if self.slot_refs[s] == 0]
        if not free:
            raise RuntimeError(
                f"all {self.max_loras} LoRA slots are in use (max_loras): the scheduler must not admit more"
            )
        slot = min(free, key=lambda s: (self.slot_lora[s] != 0, self.slot_used[s]))
        self.add_adapter(request)  # a no-op unless it was evicted from memory meanwhile
        _, weights = self.cpu_cache[lora_id]
        for layer_name, (layer, method) in self.layers.items():
            method.set_slot(layer, slot, weights.get(layer_name, [None] * len(method.slice_sizes)))
        self.slot_lora[slot] = lora_id
        return slot

    def add_request(self, row: int, request: LoRARequest | None) -> None:
        if request is None:
            self.row_slot[row] = -1
            return
        slot = self._slot_for(request)
        self._clock += 1
        self.slot_used[slot] = self._clock
        self.slot_refs[slot] += 1
        self.row_slot[row] = slot

    def remove_request(self, row: int) -> None:
        slot = self.row_slot[row]
        if slot >= 0:
            self.slot_refs[slot] -= 1
            self.row_slot[row] = -1

    # LoRA's part of a compiled block's key (a GraphKeyContributor, pagedllm.layers.graph_key).
    def owns(self, obj: object) -> bool:
        return isinstance(obj, (LoRALinearMethod, LoRABatchState))

    def graph_key(self, block: nn.Module) -> Hashable:
        """The constants of the wrapped layers' own methods (a wrapper traces its base's product)."""
        return tuple(
            m.quant_method.base.constants(m)
            for m in block.modules()
            if isinstance(getattr(m, "quant_method", None), LoRALinearMethod)
        )

    def step_graph_key(self) -> Hashable:
        """Whether adapters run this step: a step without them traces the base product only."""
        return self.state.active

    def warm_up_variants(self) -> Iterator[bool]:
        """Sets each graph variant in turn (for compiling both ahead of requests), then none active."""
        for active in (False, True):
            self.state.active = active
            yield active
        self.state.active = False

    def set_step(self, rows: np.ndarray, num_scheduled: np.ndarray) -> None:
        """Write the step's token -> slot mask (rows and token counts in batch order)."""
        slots = self.row_slot[rows]
        total = int(num_scheduled.sum())
        mask = self.state.mask
        mask[:total].zero_()
        self.state.active = bool((slots >= 0).any())
        if not self.state.active:
            return
        token_slots = torch.from_numpy(np.repeat(slots, num_scheduled))
        tokens = torch.nonzero(token_slots >= 0).squeeze(1)
        mask[tokens.to(mask.device), token_slots[tokens].to(mask.device)] = 1
