"""Parameters of one pooling request (vLLM's `PoolingParams`): what the runner returns instead of tokens.

A msgspec struct because it travels inside `EngineCoreRequest` over ZMQ, like `SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from pagedllm.errors import RequestError

PoolingTask = Literal["embed", "classify", "score"]
# Token-type ids ride in the high bits of the runner's input ids (see pagedllm.models.bert): an
# encoder's forward keeps the `(input_ids, positions)` signature every model has.
TOKEN_TYPE_SHIFT = 30


class PoolingParams(msgspec.Struct, omit_defaults=True):
    task: PoolingTask = "embed"
    """embed: a (normalised) vector; classify: the class probabilities; score: a cross-encoder's score."""
    dimensions: int | None = None
    """Matryoshka: keep the first `dimensions` values of the embedding, then normalise again."""
    normalize: bool | None = None
    """L2-normalise the embedding; unset: the model's pooler config decides."""
    use_activation: bool | None = None
    """Apply the classifier's activation (sigmoid for one label, softmax otherwise); unset: yes."""
    token_type_ids: list[int] | None = None
    """Segment of each prompt token (a cross-encoder's text pair); unset: all zero."""

    def verify(self, pooler_config: Mapping[str, Any], hidden_size: int, num_prompt_tokens: int) -> None:
        """ValueError naming the field for a request the model cannot serve."""
        tasks: Sequence[str] = pooler_config.get("tasks", ("embed",))
        if self.task not in tasks:
            raise ValueError(
                f"task={self.task!r} is not supported by this model (supported: {', '.join(tasks)})"
            )
        if self.dimensions is not None:
            if self.task != "embed":
                raise RequestError("dimensions", "dimensions applies to embeddings only")
            matryoshka = pooler_config.get("matryoshka_dimensions")
            if self.dimensions < 1 or self.dimensions > hidden_size:
                raise RequestError(
                    "dimensions",
                    f"dimensions={self.dimensions} must be between 1 and the hidden size {hidden_size}",
                )
            if matryoshka is not None and self.dimensions not in matryoshka:
                raise RequestError(
                    "dimensions",
                    f"dimensions={self.dimensions} is not one of the model's matryoshka_dimensions {list(matryoshka)}",
                )
        if self.token_type_ids is not None and len(self.token_type_ids) != num_prompt_tokens:
            raise RequestError(
                "token_type_ids",
                f"token_type_ids has {len(self.token_type_ids)} entries for a prompt of {num_prompt_tokens} tokens",
            )
        if self.token_type_ids is not None and any(not 0 <= t < 2**8 for t in self.token_type_ids):
            raise RequestError("token_type_ids", "token_type_ids must be small non-negative integers")
