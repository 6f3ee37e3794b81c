"""Sleep mode of one worker: give the KV cache (level 1) and the weights (level 2) back, then restore.

Level 1 keeps the weights in host memory (on the CPU they already are there: nothing moves; on a
device they are copied to host memory) and drops the KV cache. Level 2 drops both; waking the weights
reloads them from the checkpoint (a trainer may then push others with a weight update).

The memory really leaves the process: the KV cache is anonymous mmap'd memory on the CPU (unmapped
when its tensors die), the weights' storage is returned by the platform (`malloc_trim` on the CPU,
the caching allocator emptied on CUDA). The parameters themselves stay (emptied), so the model, its
compiled forward and every reference to the parameters remain valid across the sleep.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from pagedllm.config.sleep_mode import check_sleep_level, check_wake_tags
from pagedllm.models.loader import effective_quant_config, reload_weights
from pagedllm.platforms import current_platform

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm.worker")

def _model(runner: ModelRunner) -> torch.nn.Module:
    if runner.model is None:
        raise RuntimeError("sleep mode needs a loaded model")
    return runner.model


class WorkerSleep:
    """What a sleeping runner released, and how to restore it."""

    def __init__(self, runner: ModelRunner, engine_config: EngineConfig) -> None:
        self.runner = runner
        self.engine_config = engine_config
        self.released: set[str] = set()
        # Per parameter, while its storage is released: (shape, dtype, host copy or None to reload).
        self._weights: dict[str, tuple[torch.Size, torch.dtype, torch.Tensor | None]] = {}

    def sleep(self, level: int) -> int:
        """Release the KV cache (and at level 2 the weights); returns the bytes released."""
        level = check_sleep_level(level)
        if self.released:
            raise ValueError("the worker is already sleeping")
        if level == 2 and effective_quant_config(self.engine_config) is not None:
            # Refused before anything is released: wake-up could not reload them (`reload_weights`).
            raise ValueError("sleep level 2 is not supported for quantized models (use level 1)")
        runner = self.runner
        model = _model(runner)
        runner.release_native_bindings()
        released = runner.startup.release_kv_cache()
        self.released.add("kv_cache")
        keep_on_host = level == 1 and runner.device.type != "cpu"
        if level == 2 or keep_on_host:
            pin = current_platform.is_pin_memory_available()
            for name, param in model.named_parameters():
                host = None
                if keep_on_host:
                    host = param.data.to("cpu")
                    host = host.pin_memory() if pin else host
                self._weights[name] = (param.shape, param.dtype, host)
                released += param.numel() * param.element_size()
                param.data = torch.empty(0, dtype=param.dtype, device=runner.device)
            self.released.add("weights")
        gc.collect()
        current_platform.release_freed_memory()
        logger.info("sleep level %d: released %.1f MiB", level, released / 2**20)
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the released parts named by `tags` (all when None): weights first, then the cache."""
        wanted = [t for t in check_wake_tags(tags) if t in self.released]
        runner = self.runner
        if "weights" in wanted:
            model = _model(runner)
            reload = False
            for name, param in model.named_parameters():
                shape, dtype, host = self._weights[name]
                param.data = torch.empty(shape, dtype=dtype, device=runner.device)
                if host is not None:
                    param.data.copy_(host)
                else:
                    reload = True
            if reload:
                reload_weights(model, self.engine_config)
            self._weights.clear()
            self.released.discard("weights")
        if "kv_cache" in wanted:
            runner.initialize_kv_cache(runner.num_blocks)
            self.released.discard("kv_cache")
        logger.info("woke up %s", ", ".join(wanted) or "nothing")

    @property
    def is_sleeping(self) -> bool:
        return bool(self.released)
