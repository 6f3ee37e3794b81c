"""A tiny random Llama with a real (tiny, byte-level BPE) tokenizer and a chat template, saved as an HF
directory, so the whole offline stack - text in, text out - runs on it in milliseconds per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefills and decodes in one step.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_llm(path: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Save tokenizer + random float32 Llama (hidden 64, 2 layers, unless `config_overrides` says
    otherwise) to ``path``."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        # Peaked logits, so float summation order cannot flip a greedy near-tie.
        initializer_range=0.15,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.update(config_overrides)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (stopping at EOS like the engine)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
