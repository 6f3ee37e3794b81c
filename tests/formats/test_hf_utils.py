"""Reading transformers configs: RoPE settings in the transformers 4 and 5 styles."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import LlamaConfig

from pagedllm.formats.hf_utils import derived_max_model_len, rope_parameters, rope_scaling, rope_theta


def test_rope_helpers_old_and_new_style() -> None:
    new = LlamaConfig(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert rope_theta(new) == 5e5 and rope_scaling(new) is None
    # A transformers 4 style config: rope_theta plus a rope_scaling dict with the legacy "type" key.
    old = SimpleNamespace(
        rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=1000
    )
    assert rope_parameters(old) == {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}
    assert derived_max_model_len(old) == (2000, "max_position_embeddings x rope factor 2.0")
