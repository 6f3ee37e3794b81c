"""What a model declares to the runner beyond `forward` and `compute_logits` (checked with
`isinstance`, as vLLM's `supports_*` interfaces): the decoder layers to compile, a native
single-sequence decode path, and the auxiliary hidden states an EAGLE-3 head reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn


class NativeDecoder(Protocol):
    """`(input_ids, positions) -> hidden_states` of a step of at most `max_rows` tokens (decode rows:
    one sequence decoding, a few together, or one verifying its drafts; or every step), in one native
    call; None where it cannot serve the step (then the compiled graphs run it)."""

    max_rows: int

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None: ...

    def runs_every_step(self, bound: bool) -> bool:
        """Whether it runs every step, prompts included (then no graph is needed); `bound`: decided with
        the KV caches bound, else as far as the model tells."""
        ...

    def reserve(self, num_tokens: int) -> None:
        """Allocate what a step of `num_tokens` tokens needs now (a memory profile sees it)."""
        ...

    def release(self) -> None:
        """Drop every reference to the weights and KV caches (the next call binds them anew)."""
        ...


@runtime_checkable
class HasDecoderLayers(Protocol):
    def decoder_layers(self) -> Sequence[nn.Module]:
        """The repeated blocks of the model body, in order (each compiled once per shape class)."""
        ...


@runtime_checkable
class SupportsNativeDecode(Protocol):
    def native_decoder(self) -> NativeDecoder | None:
        """The native decode path of this model as loaded, or None (logged why) where it cannot run
        it (weights' dtype, quantized or sharded layers, the CPU, no compiler)."""
        ...


@runtime_checkable
class SupportsEagle3(Protocol):
    def set_aux_hidden_state_layers(self, layers: Sequence[int]) -> None:
        """From now on `forward` returns `(hidden_states, aux)`: aux[j] the residual stream entering
        decoder layer `layers[j]` (set once at load, so a compiled forward outputs them too; the
        native single-sequence path, which returns the final hidden states only, is then not used)."""
        ...
