"""Mixture-of-experts models end to end: `LLM.generate` greedy tokens equal transformers' on tiny
random Qwen3-MoE, Qwen2-MoE and Mixtral (logits are compared layer-free in test_models_vs_hf.py),
and the configuration accepts these architectures while refusing expert parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_llm import build_tokenizer
from tiny_models import make_tiny_model
from transformers import LlamaConfig, PreTrainedModel, Qwen3MoeConfig

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.config.args import EngineArgs
from pagedllm.models import load_model

MOE_VARIANTS = ["qwen3moe-top4-norm", "qwen2moe-top2-shared", "mixtral-top3"]
STEPS = 16


def _prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 40, 12)[:count]]


@pytest.fixture(scope="module", params=MOE_VARIANTS)
def model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    build_tokenizer().save_pretrained(path)
    return hf, path


def test_greedy_tokens_equal_transformers(model_dir: tuple[PreTrainedModel, Path]) -> None:
    hf, path = model_dir
    prompts = _prompts(4)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, enforce_eager=True, optimization_level=0)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
            )
            assert list(output.outputs[0].token_ids) == ref[0, len(prompt) :].tolist()


def test_config_marks_moe_and_refuses_expert_parallelism(model_dir: tuple[PreTrainedModel, Path]) -> None:
    _, path = model_dir
    config = EngineArgs(model=str(path), dtype="float32").create_engine_config()
    assert isinstance(config, EngineConfig)
    assert config.model_config.is_moe and config.parallel_config.is_moe_model
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        EngineArgs(model=str(path), enable_expert_parallel=True).create_engine_config()
    with pytest.raises(ValueError, match="enable_eplb"):
        EngineArgs(model=str(path), enable_eplb=True).create_engine_config()


def test_other_moe_architectures_are_refused(tmp_path: Path) -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_local_experts=8)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mixture-of-experts model LlamaForCausalLM .supported: Mixtral"):
        EngineArgs(model=str(tmp_path)).create_engine_config()


def test_experts_other_than_silu_are_refused(tmp_path: Path) -> None:
    config = Qwen3MoeConfig(
        hidden_size=32, num_attention_heads=2, num_experts=4, moe_intermediate_size=16, hidden_act="gelu"
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported for experts"):
        load_model(config, tmp_path, load_format="dummy")
