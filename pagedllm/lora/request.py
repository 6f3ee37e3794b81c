"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):  # type: ignore[call-arg]
    """An adapter by name, id and path. `lora_int_id` (>= 1) identifies it in the engine: two requests
    with the same id share one loaded copy, and prefix-cache blocks are keyed by it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # The model the adapter was trained on, as given by the server's --lora-modules JSON form.
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is required")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def lora_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None] | None:
    """One adapter (or None) per prompt from one for all or a list of one per prompt."""
    if lora_request is None:
        return None
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"got {len(loras)} lora_request entries for {num_prompts} prompts: pass one or one per prompt"
        )
    bad = [type(r).__name__ for r in loras if r is not None and not isinstance(r, LoRARequest)]
    if bad:
        raise TypeError(f"lora_request entries must be LoRARequest or None, not {bad[0]}")
    return loras
