"""HF transformers in the peer benchmark (our own env): greedy `generate` on left-padded batches of
the token-id prompts (pagedllm's HF baseline, `pagedllm.benchmarks.hf_baseline`)."""

from __future__ import annotations

import os
from typing import Any

from common import main


class HFTransformers:
    def __init__(self, job: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(job["threads"])
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[job["dtype"]]
        self.batch_size = job["hf_batch_size"]
        self.model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=self.dtype).eval()
        pad = self.model.config.pad_token_id
        self.pad = int(pad if pad is not None else (self.model.config.eos_token_id or 0))

    def generate(self, prompts: list[list[int]], output_len: int) -> int:
        from pagedllm.benchmarks.datasets import SampleRequest
        from pagedllm.benchmarks.hf_baseline import run_hf_generate

        requests = [SampleRequest(output_len=output_len, prompt_token_ids=p) for p in prompts]
        return run_hf_generate(self.model, requests, self.batch_size, self.pad).num_output_tokens

    def describe(self) -> dict[str, Any]:
        import torch
        import transformers

        flags = {
            "dtype": str(self.dtype),
            "batch_size": self.batch_size,
            "attn_implementation": self.model.config._attn_implementation,
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        }
        version = {"transformers": transformers.__version__, "torch": torch.__version__}
        return {"version": version, "flags": flags, "notes": []}


if __name__ == "__main__":
    main(HFTransformers)
