"""Gemma 3 text model: Gemma 2's blocks with per-head `(1 + weight)` q/k norms, a separate rotation
for the sliding-window layers (`rope_parameters` per layer type: the local base frequency, unscaled)
and none of Gemma 2's attention soft cap (HF's Gemma 3 does not apply `attn_logit_softcapping`)."""

from __future__ import annotations

from typing import Any

from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.gemma2 import FULL, SLIDING, Gemma2ForCausalLM
from pagedllm.models.llama import build_rope


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def build_ropes(cls, config: Any) -> dict[str, RotaryEmbedding]:
        # Gemma 3's max_position_embeddings already states the (linearly) scaled context.
        return {t: build_rope(config, t, max_positions_scaled=True) for t in (SLIDING, FULL)}

    @classmethod
    def attention_options(cls, config: Any) -> dict[str, Any]:
        options = super().attention_options(config)
        options.update(logits_soft_cap=None, qk_norm=True, norm_cls=GemmaRMSNorm)
        return options
