"""All-reduce cost at TP=2: the `mp` executor's two ranks (gloo on the CPU) time the tensor-parallel
all-reduce at the shapes of a decode step of a SmolLM2-135M-shaped Llama (8 heads so that it splits
over 2 ranks; dummy weights), and the per-step cost is that times the all-reduces per step.

Run: `python benchmarks/all_reduce_tp.py [model_dir]` (the config is written there, default a temp dir).
"""

from __future__ import annotations

import sys
import tempfile
import time
from typing import Any


def time_all_reduce(worker: Any, rows: int, hidden: int, iters: int = 200) -> float:
    """Seconds per all-reduce of a [rows, hidden] float32 tensor over this rank's TP group."""
    import torch

    from pagedllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    x = torch.randn(rows, hidden)
    for _ in range(10):
        group.all_reduce(x) + 0
    group.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        group.all_reduce(x) + 0  # `+ 0` waits for the functional collective's result
    return (time.perf_counter() - start) / iters


if __name__ == "__main__":
    from transformers import LlamaConfig

    from pagedllm import LLM

    model_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=49152,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(model_dir)
    llm = LLM(
        model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=2**26,
    )
    per_step = 2 * config.num_hidden_layers + 1  # after attention and MLP of each layer, and the embedding
    for rows in (1, 32, 256):
        t = max(llm.collective_rpc(time_all_reduce, args=(rows, config.hidden_size)))
        print(
            f"rows={rows} hidden={config.hidden_size} float32: {t * 1e6:.0f} us per all-reduce, "
            f"{per_step} per step -> {per_step * t * 1e3:.2f} ms per step"
        )
    llm.llm_engine.shutdown()
