"""Token embedding and the LM head (logits only for the rows asked for)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import linear

if TYPE_CHECKING:
    from pagedllm.config.quantization import QuantizationConfig


class VocabParallelEmbedding(nn.Module):
    """The embedding table, whole on every tensor-parallel rank (vLLM shards the vocabulary; that
    needs a padded vocabulary and a masked lookup summed across ranks, not done yet). Created in the
    default dtype, which the loader sets to the model's. With a `quant_config` whose method covers
    embeddings (GGUF kept quantized), that method holds the table and does the lookup (`embedding`)
    and the LM head's product (`apply`)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.quant_method: Any = quant_config.get_quant_method(self, prefix) if quant_config else None
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares `weight` with the embedding when the model ties them."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, quant_config, prefix)
        if bias:
            raise ValueError("an LM head bias is not supported")

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Share the embedding's table (and its method: a quantized table stays quantized)."""
        self.quant_method = embed_tokens.quant_method
        for name, param in embed_tokens.named_parameters(recurse=False):
            setattr(self, name, param)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through LogitsProcessor, not called directly")


class LogitsProcessor(nn.Module):
    """`hidden [N, H] -> float32 logits [N, vocab]`.

    The caller passes only the rows it needs (each request's last token, or prompt tokens for prompt
    logprobs), so the vocab-sized GEMM, the largest single matmul of a decode step for small models,
    is never run for the other rows. Logits are float32 so sampling and logprobs are exact.
    """

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        if lm_head.quant_method is not None:
            return lm_head.quant_method.apply(lm_head, hidden_states).float()
        return linear(hidden_states, lm_head.weight).float()
