"""Token embedding and the LM head (logits only for the rows asked for), split along the vocabulary
across tensor-parallel ranks.

Rank r holds rows `[r * p, (r + 1) * p)` of the table, `p = ceil(vocab / tp)` (the last rank's rows
past the vocabulary are zeros). The embedding looks up only the ids in its range (others give zeros)
and the ranks' partial rows are summed; the LM head computes its slice of the logits and the slices
are gathered. With one rank both are the plain table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import parallel_state
from pagedllm.layers import bf16_gemm
from pagedllm.layers.linear import linear
from pagedllm.layers.quant.base import set_weight_loader

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig


class VocabParallelEmbedding(nn.Module):
    """The embedding table (this rank's rows of it). Created in the default dtype, which the loader
    sets to the model's. With a `quant_config` whose method covers embeddings (GGUF kept quantized,
    only without tensor parallelism), that method holds the table and does the lookup (`embedding`)
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
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.rows_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_partition
        # The rows of this rank that hold real tokens (the last rank may have padding).
        self.num_real_rows = max(0, min(num_embeddings - self.vocab_start, self.rows_per_partition))
        self.quant_method: Any = quant_config.get_quant_method(self, prefix) if quant_config else None
        if self.quant_method is None:
            weight = nn.Parameter(torch.empty(self.rows_per_partition, embedding_dim))
            self.weight = set_weight_loader(weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.dim() != 2 or tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"weight shape {tuple(loaded_weight.shape)} does not match "
                f"({self.num_embeddings}, {self.embedding_dim})"
            )
        param.data[: self.num_real_rows].copy_(loaded_weight.narrow(0, self.vocab_start, self.num_real_rows))
        param.data[self.num_real_rows :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_real_rows)
        rows = F.embedding(local.masked_fill(~mine, 0), self.weight)
        rows = rows.masked_fill(~mine.unsqueeze(-1), 0)
        return parallel_state.tensor_model_parallel_all_reduce(rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


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
    is never run for the other rows. Logits are float32 so sampling and logprobs are exact. A
    bfloat16 head on a CPU with AVX512-BF16 computes them with the batch-invariant kernel
    (`bf16_gemm`), in float32 throughout (not rounded to bfloat16 first): a row's logits are bitwise
    the same whatever other rows are computed with it. Under tensor parallelism every rank returns
    the whole (gathered) logits.
    """

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        if lm_head.quant_method is not None:
            return lm_head.quant_method.apply(lm_head, hidden_states).float()
        if bf16_gemm.serves(hidden_states, lm_head.weight):
            logits = torch.ops.pagedllm.bf16_linear(hidden_states, lm_head.weight, None, True)
        else:
            logits = linear(hidden_states, lm_head.weight).float()
        if lm_head.tp_size == 1:
            return logits
        gathered = parallel_state.tensor_model_parallel_all_gather(logits, dim=-1)
        return gathered[:, : lm_head.num_embeddings]
