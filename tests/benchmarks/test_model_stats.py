from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig

from pagedllm.benchmarks.model_stats import ModelStats, resident_weight_bytes_per_step
from pagedllm.layers.quant.fp8 import Fp8QuantizationConfig
from pagedllm.models.loader import load_model


def _llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


@pytest.mark.parametrize("tied", [True, False])
def test_param_count_matches_hf_model(tied):
    cfg = _llama_config(tied)
    model = LlamaForCausalLM(cfg)
    expected = sum(p.numel() for p in model.parameters())
    stats = ModelStats.from_model_config(SimpleNamespace(hf_text_config=cfg, dtype=torch.bfloat16))
    assert stats.num_params == expected


def _qwen2_moe_config() -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
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


def test_moe_counts_the_parameters_one_token_uses():
    """All of the HF Qwen2-MoE model but the experts no token uses: (8 - 2) of 8 per layer."""
    from transformers import Qwen2MoeForCausalLM

    cfg = _qwen2_moe_config()
    total = sum(p.numel() for p in Qwen2MoeForCausalLM(cfg).parameters())
    unused_experts = 2 * (8 - 2) * 3 * 64 * 32
    biases = 2 * (64 + 2 * 32)  # q/k/v biases, not counted
    stats = ModelStats.from_model_config(SimpleNamespace(hf_text_config=cfg, dtype=torch.float32))
    assert stats.num_params == total - unused_experts - biases


def _saved(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_resident_bytes_of_a_float_model_are_its_parameters_read(tmp_path: Path, tied: bool) -> None:
    """HF's bfloat16 parameter bytes, but the embedding table when it is not the LM head (a step
    gathers one row of it)."""
    cfg = _llama_config(tied)
    hf = _saved(LlamaForCausalLM(cfg), tmp_path)
    model = load_model(cfg, tmp_path, dtype=torch.bfloat16)
    expected = sum(p.numel() for p in hf.parameters()) - (0 if tied else 300 * 64)
    assert resident_weight_bytes_per_step(model) == 2 * expected


def test_resident_bytes_of_an_fp8_model_count_one_byte_a_weight(tmp_path: Path) -> None:
    """The linear layers at one byte a weight plus a float32 scale a row; the rest bfloat16."""
    cfg = _llama_config(False)
    hf = _saved(LlamaForCausalLM(cfg), tmp_path)
    model = load_model(cfg, tmp_path, dtype=torch.bfloat16, quant_config=Fp8QuantizationConfig())
    expected = 0
    for name, p in hf.named_parameters():
        if name.endswith("_proj.weight"):
            expected += p.numel() + 4 * p.shape[0]
        elif name != "model.embed_tokens.weight":
            expected += 2 * p.numel()
    assert resident_weight_bytes_per_step(model) == expected


def test_resident_bytes_of_experts_are_the_top_k_a_token_uses(tmp_path: Path) -> None:
    from transformers import Qwen2MoeForCausalLM

    cfg = _qwen2_moe_config()
    hf = _saved(Qwen2MoeForCausalLM(cfg), tmp_path)
    model = load_model(cfg, tmp_path, dtype=torch.float32)
    unused_experts = 2 * (8 - 2) * 3 * 64 * 32
    assert resident_weight_bytes_per_step(model) == 4 * (
        sum(p.numel() for p in hf.parameters()) - unused_experts
    )
