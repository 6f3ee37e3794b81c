"""Tiny base models with a tokenizer (Llama, Qwen2) and random PEFT LoRA adapters saved beside them,
plus PEFT's own logits and greedy tokens on the same weights (the reference)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_llm import build_tokenizer, make_tiny_llm
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM


def make_base(kind: str, path: Path) -> Path:
    if kind == "llama":
        return make_tiny_llm(path)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        initializer_range=0.15,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@dataclass
class AdapterSpec:
    r: int
    target_modules: list[str]
    lora_alpha: int = 16
    use_rslora: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


# Different ranks, targets (split and all projections) and scalings (alpha/r, rsLoRA, alpha_pattern).
SPECS = {
    "qv8": AdapterSpec(8, ["q_proj", "v_proj"]),
    "all4-rs": AdapterSpec(
        4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, True
    ),
    "mlp16": AdapterSpec(
        16, ["gate_proj", "down_proj", "o_proj"], 32, extra={"alpha_pattern": {"down_proj": 8}}
    ),
}


def make_adapter(base: Path, out: Path, spec: AdapterSpec, seed: int) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        target_modules=spec.target_modules,
        use_rslora=spec.use_rslora,
        init_lora_weights=False,  # random B: the adapter changes the output
        **spec.extra,
    )
    get_peft_model(model, config).save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path | None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


@torch.no_grad()
def check_against_peft(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], logprobs: list[float]
) -> None:
    """`tokens` are PEFT's greedy continuation of `prompt` and `logprobs` their log-probabilities: one
    teacher-forced forward gives every step's distribution (a step's argmax is its greedy token)."""
    rows = model(input_ids=torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)[len(prompt) - 1 : -1]
    assert rows.argmax(-1).tolist() == tokens
    want = rows[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(logprobs), want, atol=2e-4, rtol=0)


@torch.no_grad()
def peft_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """PEFT's greedy continuation (no EOS stop) and the log-probability of each chosen token."""
    ids, logprobs = list(prompt), []
    for _ in range(max_new_tokens):
        row = model(input_ids=torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        ids.append(int(row.argmax()))
        logprobs.append(float(row.max()))
    return ids[len(prompt) :], logprobs
