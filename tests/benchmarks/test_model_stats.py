from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.benchmarks.model_stats import ModelStats


@pytest.mark.parametrize("tied", [True, False])
def test_param_count_matches_hf_model(tied):
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)
    expected = sum(p.numel() for p in model.parameters())
    stats = ModelStats.from_model_config(SimpleNamespace(hf_text_config=cfg, dtype=torch.bfloat16))
    assert stats.num_params == expected
    assert stats.dtype_bytes == 2
    # The embedding gather is not a full read; the LM head (tied or not) is.
    assert stats.num_params_read_per_step == expected - (0 if tied else 300 * 64)
