"""LoRA as a linear method: the base method's product plus every token's adapter delta.

Each wrapped layer holds fixed-size stacked slots of `max_loras` adapters (zero where a slot is free or
an adapter does not target this projection), so the compiled graphs see the same shapes whatever is
loaded; loading an adapter writes its slot in place. The delta of a whole mixed batch is two dense
products, in the manner of punica's SGMV but without a per-adapter loop:

    shrink:  h = x @ A_all^T                  [T, n * S * r]   every slot's A for every token
    select:  h *= mask[t, s]                  one-hot of each token's slot (all zero: base model)
    expand:  delta_i = h_i @ B_all_i          [T, out_i]        per fused output slice i (n <= 3)

where S = max_loras, r = max_lora_rank and the output slices are those of a fused layer (q/k/v or
gate/up), each with its own A and B. The mask is one tensor shared by every layer and rewritten each
step (`LoRABatchState`); a token computes all S slots' shrink, which on a CPU costs less than gathering
a weight matrix per token (punica's BGMV) as long as S * r is small next to the layer's width.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quant.base import LinearMethodBase, NativeMatvec, WeightLoader


class LoRABatchState:
    """What every LoRA layer reads of the current step: `mask[t, s]` = 1 where token t runs the
    adapter in slot s, and whether any token of the step runs one."""

    def __init__(self, max_num_tokens: int, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.mask = torch.zeros(max_num_tokens, max_loras, dtype=dtype, device=device)
        self.active = False


class LoRALinearMethod(LinearMethodBase):
    """Wraps a layer's method (`base`): its weights and product stay the base's, plus the adapters."""

    def __init__(
        self,
        base: LinearMethodBase,
        layer: nn.Module,
        slice_sizes: list[int],
        state: LoRABatchState,
        max_rank: int,
    ) -> None:
        self.base = base
        self.state = state
        self.slice_sizes = list(slice_sizes)
        self.max_rank = max_rank
        self.num_slots = state.mask.shape[1]
        n, s, r = len(slice_sizes), self.num_slots, max_rank
        dtype, device = state.mask.dtype, state.mask.device
        in_size = int(layer.input_size_per_partition)  # type: ignore[arg-type]
        # Buffers (not parameters): the checkpoint loader and weight updates never see them.
        layer.register_buffer("lora_a", torch.zeros(n * s * r, in_size, dtype=dtype, device=device), False)
        layer.register_buffer(
            "lora_b", torch.zeros(n, s * r, max(slice_sizes), dtype=dtype, device=device), False
        )
        layer.register_buffer("lora_mask", state.mask, False)

    # The base's weights, loading and post-processing are untouched.
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        self.base.create_weights(
            layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor | None:
        # The base product alone: the native decode path, which reads this, steps aside for any step
        # where an adapter is active (`adds_to_base`).
        return self.base.dense_weight(layer)

    def native_matvec(self, layer: nn.Module) -> NativeMatvec | None:
        # The base product alone, as for dense_weight.
        return self.base.native_matvec(layer)

    def may_add_to_base(self) -> bool:
        return True

    def adds_to_base(self) -> bool:
        return self.state.active

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        if not self.state.active:
            # A step of base-model tokens only costs what it costs without LoRA (compiled graphs are
            # keyed by this flag: `LoRAManager.step_graph_key`).
            return y
        a: torch.Tensor = layer.lora_a  # type: ignore[assignment]
        b: torch.Tensor = layer.lora_b  # type: ignore[assignment]
        mask: torch.Tensor = layer.lora_mask  # type: ignore[assignment]
        n, s, r = len(self.slice_sizes), self.num_slots, self.max_rank
        rows = x.reshape(-1, x.shape[-1])
        t = rows.shape[0]
        h = torch.mm(rows.to(a.dtype), a.t()).view(t, n, s, r) * mask[:t].view(t, 1, s, 1)
        h = h.view(t, n, s * r)
        parts = [torch.mm(h[:, i], b[i, :, :size]) for i, size in enumerate(self.slice_sizes)]
        delta = parts[0] if n == 1 else torch.cat(parts, dim=1)
        return y + delta.view(y.shape).to(y.dtype)

    # ------------------------------------------------------------------------------- slots
    def set_slot(
        self, layer: nn.Module, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None]
    ) -> None:
        """Write slot `slot`: per output slice, (A [rank, in], B [out_i, rank] scaled) or None (zero)."""
        n, s, r = len(self.slice_sizes), self.num_slots, self.max_rank
        a = layer.lora_a.view(n, s, r, -1)  # type: ignore[union-attr]
        b = layer.lora_b.view(n, s, r, -1)  # type: ignore[union-attr]
        a[:, slot].zero_()
        b[:, slot].zero_()
        for i, pair in enumerate(slices):
            if pair is None:
                continue
            lora_a, lora_b = pair
            rank = lora_a.shape[0]
            a[i, slot, :rank].copy_(lora_a)
            b[i, slot, :rank, : self.slice_sizes[i]].copy_(lora_b.t())
