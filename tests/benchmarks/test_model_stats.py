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


def test_moe_counts_the_parameters_one_token_uses():
    """All of the HF Qwen2-MoE model but the experts no token uses: (8 - 2) of 8 per layer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    total = sum(p.numel() for p in Qwen2MoeForCausalLM(cfg).parameters())
    unused_experts = 2 * (8 - 2) * 3 * 64 * 32
    biases = 2 * (64 + 2 * 32)  # q/k/v biases, not counted
    stats = ModelStats.from_model_config(SimpleNamespace(hf_text_config=cfg, dtype=torch.float32))
    assert stats.num_params == total - unused_experts - biases
