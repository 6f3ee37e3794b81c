"""Tiny base models with a tokenizer (Llama, Qwen2) and random PEFT LoRA adapters saved beside them,
plus PEFT's own logits and greedy tokens on the same weights (the reference)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_llm import make_tiny_llm
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM


def make_base(kind: str, path: Path) -> Path:
    """The tiny Llama of `tiny_llm` (with its tokenizer), or a Qwen2 of the same shape in its place."""
    make_tiny_llm(path)
    if kind == "llama":
        return path
    llama = AutoConfig.from_pretrained(path).to_dict()
    shared = {k: v for k, v in llama.items() if k in Qwen2Config().to_dict() and k != "model_type"}
    torch.manual_seed(1)
    Qwen2ForCausalLM(Qwen2Config(**{**shared, "tie_word_embeddings": False})).save_pretrained(path)
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


def make_adapters(root: Path) -> dict[str, Path]:
    """A tiny Llama base ("base") and one adapter per entry of SPECS, under `root`."""
    base = make_base("llama", root / "base")
    paths = {
        name: make_adapter(base, root / name, spec, seed) for seed, (name, spec) in enumerate(SPECS.items())
    }
    return {**paths, "base": base}


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
