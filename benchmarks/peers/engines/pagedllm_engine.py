"""pagedllm in the peer benchmark: `LLM.generate` on token-id prompts (run by the driver's Python with
the checkout on PYTHONPATH; threads from OMP_NUM_THREADS, which the driver sets for every engine)."""

from __future__ import annotations

import os
from typing import Any

from common import ENGINE_CONFIG_FIELDS, OfflineLLM, config_summary, llm_kwargs, main


class PagedLLM(OfflineLLM):
    def __init__(self, job: dict[str, Any]) -> None:
        from pagedllm import LLM, SamplingParams

        self.kwargs: dict[str, Any] = {
            "kv_cache_memory_bytes": int(job["kv_cache_gib"] * 2**30),
            **llm_kwargs(job, "pagedllm"),
        }
        if job["model"].endswith(".gguf"):
            # The quantized-execution path unless the job asks for the dequantized (float) one.
            dequantize = job.get("gguf_dequantize", False)
            self.kwargs["model_loader_extra_config"] = {"gguf_dequantize": dequantize}
        super().__init__(LLM(**self.kwargs), SamplingParams)

    def describe(self) -> dict[str, Any]:
        import subprocess

        import torch

        import pagedllm

        config = self.llm.llm_engine.engine_config
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True, text=True, cwd=os.path.dirname(pagedllm.__file__),
        ).stdout.strip()
        flags = {
            **{k: str(v) for k, v in self.kwargs.items()},
            **config_summary(config, ENGINE_CONFIG_FIELDS),
            "optimization_level": str(config.optimization_level),
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        }
        version = {"pagedllm": f"{pagedllm.__version__} ({commit})", "torch": torch.__version__}
        return {"version": version, "flags": flags, "notes": []}


if __name__ == "__main__":
    main(PagedLLM)
