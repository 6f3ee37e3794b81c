"""Parameter counts of a decoder-only model from its config, and the weight bytes a decode step reads
from the loaded model (for the rooflines).

For a mixture-of-experts model the counts are of the parameters one token uses (its `top_k` routed
experts, the shared expert and the router), which is what its compute costs."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

from torch import nn

from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.fused_moe.layer import FusedMoE
from pagedllm.layers.rotary import RotaryEmbedding


@dataclass
class ModelStats:
    num_params: int
    hidden_size: int
    intermediate_size: int

    @classmethod
    def from_model_config(cls, model_config) -> ModelStats:
        cfg = model_config.hf_text_config
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + _mlp_params(cfg)
        layer += 2 * hidden  # the two RMSNorm weights
        embed = cfg.vocab_size * hidden
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        body = cfg.num_hidden_layers * layer + hidden
        num_params = body + embed * (1 if tied else 2)
        return cls(
            num_params=num_params,
            hidden_size=hidden,
            intermediate_size=inter,
        )


def _mlp_params(cfg) -> int:
    """Feed-forward parameters one token uses in a layer (dense, or routed + shared experts + router)."""
    hidden = cfg.hidden_size
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    if not experts:
        return 3 * hidden * cfg.intermediate_size
    expert_inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    shared = getattr(cfg, "shared_expert_intermediate_size", None) or 0
    shared_params = 3 * hidden * shared + hidden if shared else 0  # the shared expert and its gate
    return cfg.num_experts_per_tok * 3 * hidden * expert_inter + shared_params + hidden * experts


def resident_weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of the weights one single-sequence decode step reads, as `model` holds them: each parameter
    and buffer once, at its stored size (GGUF blocks, AWQ/GPTQ nibbles, fp8 weights, with their scales),
    of the experts of a mixture-of-experts layer the `top_k` a token uses, and not the tables a step
    gathers one row of (the rotary cos/sin cache, the token embedding unless it is the tied LM head)."""
    read: dict[int, float] = {}
    for module in model.modules():
        gathered = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
        if gathered or isinstance(module, RotaryEmbedding):
            continue  # a tied LM head holds the embedding table too: counted there
        share = module.top_k / module.num_experts if isinstance(module, FusedMoE) else 1.0
        for tensor in chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            read[tensor.data_ptr()] = tensor.nbytes * share
    return int(sum(read.values()))


def worker_weight_bytes_per_step(worker: Any) -> int:
    """`resident_weight_bytes_per_step` of a worker's model (through `collective_rpc`: one rank's part)."""
    return resident_weight_bytes_per_step(worker.runner.model)


def worker_forward_path_steps(worker: Any) -> dict[str, int]:
    """Steps each forward path (native-c, compiled, eager: `pagedllm.worker.forward_paths`) ran in a
    worker since it started (through `collective_rpc`)."""
    paths = worker.runner.forward_paths
    return {} if paths is None else dict(paths.steps)


def worker_attention_backends(worker: Any) -> dict[str, list[str]]:
    """The attention backends each step class runs on in a worker (`AttentionMetadataBuilder.
    backend_names`; through `collective_rpc`), empty before its cache is bound."""
    builder = worker.runner.startup.attn_metadata_builder
    return {} if builder is None else builder.backend_names()
