"""BERT encoders (all-MiniLM, BGE, E5 shapes): `BertModel` for embeddings and
`BertForSequenceClassification` for cross-encoder scores.

Bidirectional attention over each whole prompt (`pagedllm.attention.encoder`, no KV cache), absolute
position embeddings, token-type embeddings and post-LayerNorm residual blocks. Module names mirror HF's,
so the generic loader maps the checkpoint with only q/k/v folded into one projection. Token-type ids
arrive in the high bits of the input ids (`pagedllm.pooling_params.TOKEN_TYPE_SHIFT`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.encoder import encoder_attention
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.models.loader.weights import packed_modules
from pagedllm.pooling_params import TOKEN_TYPE_SHIFT

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not supported")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        token_types = input_ids >> TOKEN_TYPE_SHIFT
        token_ids = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        x = self.word_embeddings(token_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


class BertLayer(nn.Module):
    def __init__(self, config: Any, prefix: str, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.scale = (hidden // heads) ** -0.5
        act = config.hidden_act
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} is not supported (only {', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        eps = config.layer_norm_eps
        # HF's nesting: attention.self.{query,key,value}, attention.output.{dense,LayerNorm},
        # intermediate.dense, output.{dense,LayerNorm}.
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        self.attention.self.qkv_proj = QKVParallelLinear(
            hidden, hidden // heads, heads, heads, True, quant_config, f"{prefix}.attention.self.qkv_proj"
        )
        self.attention.output = nn.Module()
        self.attention.output.dense = RowParallelLinear(
            hidden, hidden, True, quant_config, f"{prefix}.attention.output.dense"
        )
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = ColumnParallelLinear(
            hidden, config.intermediate_size, True, quant_config, f"{prefix}.intermediate.dense"
        )
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(
            config.intermediate_size, hidden, True, quant_config, f"{prefix}.output.dense"
        )
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attention.self.qkv_proj(x).chunk(3, dim=-1)
        attn = self.attention.output.dense(encoder_attention(q, k, v, self.num_heads, self.scale))
        x = self.attention.output.LayerNorm(attn + x)
        h = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(h + x)


class BertEncoderModel(nn.Module):
    """Embeddings and encoder layers (HF's `BertModel` without its pooler)."""

    def __init__(self, config: Any, prefix: str, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config, f"{prefix}encoder.layer.{i}", quant_config)
            for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x)
        return x


class BertModel(BertEncoderModel):
    """An embedding model: the hidden states go to the engine's pooler (CLS / MEAN / LAST)."""

    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        ("qkv_proj", "query", "q"),
        ("qkv_proj", "key", "k"),
        ("qkv_proj", "value", "v"),
    ]
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = packed_modules(stacked_params_mapping)
    # HF's pooler (dense + tanh over CLS) is not part of an embedding; MLM heads and the position-id
    # buffer carry nothing either.
    skip_weight_substrs: ClassVar[tuple[str, ...]] = ("pooler.", "cls.", "position_ids")

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, "", quant_config)
        self.config = config


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: BERT, its pooler (dense + tanh over the CLS token), and a linear classifier."""

    stacked_params_mapping = BertModel.stacked_params_mapping
    packed_modules_mapping = BertModel.packed_modules_mapping
    skip_weight_substrs: ClassVar[tuple[str, ...]] = ("position_ids",)

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.bert = BertEncoderModel(config, "bert.", quant_config)
        self.bert.pooler = nn.Module()
        self.bert.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids, positions)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.bert.pooler.dense(pooled)))
