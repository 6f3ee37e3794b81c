"""Parameter and weight-byte counts of a decoder-only model, from its config (for the rooflines).

For a mixture-of-experts model the counts are of the parameters one token uses (its `top_k` routed
experts, the shared expert and the router), which is what its compute and single-stream decode cost."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelStats:
    num_params: int
    # Parameters read from memory per decode step (the embedding table is gathered, not read, unless
    # it doubles as the LM head).
    num_params_read_per_step: int
    hidden_size: int
    intermediate_size: int
    dtype_bytes: int

    @property
    def weight_bytes_per_step(self) -> int:
        return self.num_params_read_per_step * self.dtype_bytes

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
            num_params_read_per_step=body + embed,
            hidden_size=hidden,
            intermediate_size=inter,
            dtype_bytes=model_config.dtype.itemsize,
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
