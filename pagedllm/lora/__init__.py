"""Multi-LoRA serving: PEFT adapters applied per token over one base model.

`request.py` (the `LoRARequest` a caller names an adapter with) is pure Python, so the scheduler and
the front-end can use it; the torch parts (`peft_loader`, `layers`, `manager`) live beside it and are
imported only by the worker.
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
