"""Llama-family decoder (Llama 2/3/3.x, SmolLM2, TinyLlama); the other dense families reuse its blocks.

Architecture only: the HF -> fused weight-name mapping is `stacked_params_mapping` below, applied by the
generic loader (`pagedllm.models.loader.weights`). Every linear layer takes the `QuantizationConfig` and
its prefix (its name in the model), so the config chooses its method. The forward is `forward(input_ids, positions) -> hidden_states` over a flattened batch
(no padding, no batch dimension); attention metadata arrives through the forward context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from pagedllm.attention import Attention
from pagedllm.distributed import parallel_state
from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.pp_missing import PPMissingLayer
from pagedllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedllm.models.interfaces import NativeDecoder, SupportsEagle3
from pagedllm.models.loader.weights import packed_modules

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig


# `(layer index, module prefix) -> feed-forward block` of a layer (None: the dense `LlamaMLP`).
MLPFactory = Callable[[int, str], nn.Module]


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def build_rope(
    config: Any, layer_type: str | None = None, max_positions_scaled: bool = False
) -> RotaryEmbedding:
    """The rotary table for `config` (for layers of `layer_type` where the rotation differs by type)."""
    theta, scaling = rope_parameters_from_config(config, layer_type)
    partial = getattr(config, "partial_rotary_factor", None) or (scaling or {}).get("partial_rotary_factor")
    return get_rope(
        head_dim(config),
        config.max_position_embeddings,
        theta,
        scaling,
        float(partial or 1.0),
        max_positions_scaled,
    )


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.act_fn = get_act_and_mul(hidden_act)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, quant_config, f"{prefix}.down_proj"
        )

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
        quant_config: QuantizationConfig | None = None,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
        norm_cls: Callable[..., RMSNorm] = RMSNorm,
        qk_norm_whole: bool = False,
    ) -> None:
        """`scale` of the scores (default head_dim^-0.5), `logits_soft_cap` (Gemma 2), q/k norms of
        `norm_cls` per head (Qwen3, Gemma 3) or over the whole projection (`qk_norm_whole`, OLMo 2)."""
        super().__init__()
        hidden_size = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            qkv_bias,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, hidden_size, o_bias, quant_config, f"{prefix}.o_proj"
        )
        # Qwen3 normalizes each head of q and k before rotary, OLMo 2 the whole projections.
        self.qk_norm_whole = qk_norm_whole
        q_width, k_width = (
            (total_heads * self.head_dim, total_kv_heads * self.head_dim)
            if qk_norm_whole
            else (self.head_dim, self.head_dim)
        )
        self.q_norm = norm_cls(q_width, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm_cls(k_width, eps=config.rms_norm_eps) if qk_norm else None
        # The model's one rotary table, shared by every layer (registered under each of them).
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            self.num_kv_heads,
            sliding_window=sliding_window,
            prefix=f"{prefix}.attn",
            logits_soft_cap=logits_soft_cap,
        )

    def _head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if self.qk_norm_whole:
            return norm(x)  # type: ignore[return-value]
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
    """Pre-norm attention and MLP blocks; other families' blocks subclass it (their own norms and
    forward, the same attention, MLP and weight names)."""

    # The norms of the block (OLMo 2 and Gemma have variants).
    norm_cls: ClassVar[Callable[..., RMSNorm]] = RMSNorm

    def __init__(
        self,
        config: Any,
        prefix: str,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        mlp: nn.Module | None = None,
        **attn_options: Any,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, f"{prefix}.self_attn", rotary_emb, quant_config=quant_config, **attn_options
        )
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            # Gemma names it `hidden_activation`.
            getattr(config, "hidden_activation", None) or config.hidden_act,
            bool(getattr(config, "mlp_bias", False)),
            quant_config,
            f"{prefix}.mlp",
        )
        self.input_layernorm = self.make_norm(config)
        self.post_attention_layernorm = self.make_norm(config)

    def make_norm(self, config: Any) -> RMSNorm:
        return self.norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    def input_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_layernorm(hidden + residual), hidden + residual)`; the first layer has no residual."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states  # type: ignore[return-value]
        return self.input_layernorm(hidden_states, residual)  # type: ignore[return-value]

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str,
        attn_options: dict[str, Any],
        quant_config: QuantizationConfig | None = None,
        layer_cls: type[nn.Module] = LlamaDecoderLayer,
        norm_cls: Callable[..., RMSNorm] = RMSNorm,
        embed_scale: float | None = None,
        mlp_factory: MLPFactory | None = None,
    ) -> None:
        """`layer_cls` the decoder block (a Llama-style `(positions, hidden, residual)` one),
        `norm_cls` the final norm, `embed_scale` a factor on the embeddings (Granite), `mlp_factory`
        each layer's feed-forward block (mixture-of-experts models; None: the block's dense MLP)."""
        super().__init__()
        # This pipeline stage's part: its layers, the embedding on the first, the norm on the last
        # (the other layers are placeholders, so layer indices and weight names stay global).
        pp = parallel_state.get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = parallel_state.get_pp_indices(
            config.num_hidden_layers, pp.rank_in_group, pp.world_size
        )
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config, f"{prefix}.embed_tokens")
            if self.is_first_stage
            else PPMissingLayer()
        )
        self.embed_scale = embed_scale
        rotary_emb = build_rope(config)
        self.layers = nn.ModuleList(
            layer_cls(
                config,
                f"{prefix}.layers.{i}",
                rotary_emb,
                quant_config,
                mlp_factory(i, f"{prefix}.layers.{i}.mlp") if mlp_factory else None,
                **attn_options,
            )
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        # The layers whose input stream `forward` also returns (an EAGLE-3 head reads them).
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def set_aux_hidden_state_layers(self, layers: Sequence[int]) -> None:
        if not (self.is_first_stage and self.is_last_stage):
            raise ValueError("auxiliary hidden states are not returned by a pipeline stage")
        if not all(0 <= i < len(self.layers) for i in layers):
            raise ValueError(
                f"auxiliary hidden-state layers {list(layers)} are not all among this model's "
                f"{len(self.layers)} layers"
            )
        self.aux_hidden_state_layers = tuple(layers)

    def missing_prefixes(self, prefix: str) -> tuple[str, ...]:
        """The weight-name prefixes of the modules other pipeline stages hold."""
        return tuple(
            f"{prefix}.{name}."
            for name, module in self.named_modules()
            if isinstance(module, PPMissingLayer)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """The final hidden states; a stage before the last returns `(hidden, residual)` for the
        next stage, and a stage after the first starts from the previous one's (`intermediate`).
        With `aux_hidden_state_layers`, `(hidden, aux)`: the stream (hidden + residual) entering each."""
        residual: torch.Tensor | None
        if intermediate is None:
            hidden_states = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden_states = hidden_states * self.embed_scale
            residual = None
        else:
            hidden_states, residual = intermediate
        if self.aux_hidden_state_layers:
            return self._forward_with_aux(positions, hidden_states)
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_stage:
            assert residual is not None
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _forward_with_aux(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layers and final norm of a whole model from its embeddings, and the stream entering
        each auxiliary layer (its own loop, so the plain forward pays nothing for the feature)."""
        aux: dict[int, torch.Tensor] = {}
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:
                aux[i] = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, [aux[i] for i in self.aux_hidden_state_layers]


class LlamaForCausalLM(nn.Module):
    # HF checkpoint projections folded into our fused ones at load time: (fused module, checkpoint
    # module, shard id of the fused layer's weight_loader).
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = packed_modules(stacked_params_mapping)
    # The decoder block (its `norm_cls` is also the final norm's).
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    # Checkpoint tensors with no parameter here (old HF checkpoints store the rotary frequencies).
    skip_weight_substrs: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    # Whether the model body splits into pipeline stages (`LlamaModel` does; other bodies may not).
    supports_pp: ClassVar[bool] = True

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, quant_config)
        pp = parallel_state.get_pp_group()
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
            if pp.is_last_rank else PPMissingLayer()
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_weights()
        self.logits_processor = LogitsProcessor()
        if pp.world_size > 1:
            # Checkpoint names of other stages' modules are skipped by the loader; a last stage with
            # tied embeddings loads the embedding table into its own LM head.
            missing = self.model.missing_prefixes("model")  # type: ignore[operator]
            missing += () if pp.is_last_rank else ("lm_head.",)
            self.skip_weight_substrs = (*type(self).skip_weight_substrs, *missing)
            if self.tie_word_embeddings and not pp.is_first_rank:
                self.hf_name_substitutions = {
                    **getattr(type(self), "hf_name_substitutions", {}),
                    "model.embed_tokens.": "lm_head.",
                }

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (the loader then skips a checkpoint's `lm_head.weight`)."""
        if self.tie_word_embeddings and isinstance(self.lm_head, ParallelLMHead):
            if isinstance(self.model.embed_tokens, VocabParallelEmbedding):
                self.lm_head.tie_weights(self.model.embed_tokens)

    @classmethod
    def build_model(cls, config: Any, quant_config: QuantizationConfig | None) -> nn.Module:
        """The model body (`model.*` weights): families with another layout build theirs."""
        return LlamaModel(
            config,
            "model",
            cls.attention_options(config),
            quant_config,
            layer_cls=cls.layer_cls,
            norm_cls=cls.layer_cls.norm_cls,
            embed_scale=cls.embed_scale(config),
            mlp_factory=cls.mlp_factory(config, quant_config),
        )

    @classmethod
    def embed_scale(cls, config: Any) -> float | None:
        """A factor on the token embeddings (Granite's multiplier), None for none."""
        return None

    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        """The per-architecture knobs of the shared attention block."""
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding_window": None}

    @classmethod
    def mlp_factory(cls, config: Any, quant_config: QuantizationConfig | None) -> MLPFactory | None:
        """The feed-forward blocks of the layers (mixture-of-experts models); None: dense `LlamaMLP`s."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if intermediate is None:  # bodies without pipeline stages take two arguments
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def set_aux_hidden_state_layers(self, layers: Sequence[int]) -> None:
        """`SupportsEagle3`, where the body collects the streams (families with their own bodies may not)."""
        if not isinstance(self.model, SupportsEagle3):
            raise ValueError(f"{type(self).__name__} does not return auxiliary hidden states (EAGLE-3 targets)")
        self.model.set_aux_hidden_state_layers(layers)

    def decoder_layers(self) -> Sequence[nn.Module]:
        # This pipeline stage's layers (the others are placeholders).
        return self.model.layers[self.model.start_layer : self.model.end_layer]

    def native_decoder(self) -> NativeDecoder | None:
        # Imported here: the native module loads ctypes bindings only models that run natively need.
        from pagedllm.models.native.llama_decode import LlamaNativeDecoder

        return LlamaNativeDecoder.for_model(self)
