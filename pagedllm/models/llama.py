"""Llama-family decoder (Llama 2/3/3.x, SmolLM2, TinyLlama); Mistral, Qwen2 and Qwen3 reuse it.

Architecture only: the HF -> fused weight-name mapping is `packed_modules_mapping` below, applied by
`load_weights`. The forward is `forward(input_ids, positions) -> hidden_states` over a flattened batch
(no padding, no batch dimension); attention metadata arrives through the forward context.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.attention import Attention
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedllm.models.loader.errors import ModelLoadError


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def build_rope(config: Any) -> RotaryEmbedding:
    theta, scaling = rope_parameters_from_config(config)
    return get_rope(
        head_dim(config),
        config.max_position_embeddings,
        theta,
        scaling,
        float(getattr(config, "partial_rotary_factor", 1.0) or 1.0),
    )


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias
        )
        self.o_proj = RowParallelLinear(self.q_size, hidden_size, bias=o_bias)
        # Qwen3 normalizes each head of q and k before rotary.
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
        # The model's one rotary table, shared by every layer (registered under each of them).
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window,
            prefix=f"{prefix}.attn",
        )

    def _head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x.view(x.shape[0], -1, self.head_dim)).view(x.shape[0], -1)  # type: ignore[union-attr]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self._head_norm(q, self.q_norm)
            k = self._head_norm(k, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, prefix: str, rotary_emb: RotaryEmbedding, **attn_options: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", rotary_emb, **attn_options)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, prefix: str, attn_options: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = build_rope(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, f"{prefix}.layers.{i}", rotary_emb, **attn_options)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # HF checkpoint module name -> (our fused module, shard id) folded at load time.
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, "model", self.attention_options(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_weights()
        self.logits_processor = LogitsProcessor()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties them)."""
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        """The per-architecture knobs of the shared attention block."""
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding_window": None}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into our (fused) parameters; raise on unknown names and
        on parameters (or fused shards) the checkpoint did not provide. Returns the loaded names."""
        params = dict(self.named_parameters())
        shards_needed: dict[str, set[str | int]] = {}
        for fused, shard in self.packed_modules_mapping.values():
            for name in params:
                if f".{fused}." in name:
                    shards_needed.setdefault(name, set()).add(shard)
        shards_seen: dict[str, set[str | int]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = name, None
            for hf_name, (fused, shard_id) in self.packed_modules_mapping.items():
                if f".{hf_name}." in name:
                    target, shard = name.replace(f".{hf_name}.", f".{fused}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}"
                )
            # Parameters are looked up by name and loaded by their module: materializing the model
            # (`to_empty`) replaces the Parameter objects, so nothing is attached to them.
            owner = self.get_submodule(target.rpartition(".")[0])
            loader = getattr(owner, "weight_loader", default_weight_loader)
            try:
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
                    shards_seen.setdefault(target, set()).add(shard)
            except ValueError as e:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
            loaded.add(target)
        partial = sorted(n for n, need in shards_needed.items() if n in loaded and shards_seen.get(n) != need)
        missing = sorted(set(params) - loaded) + partial
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing weights for: {', '.join(missing[:10])}"
                + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else "")
            )
        return loaded
