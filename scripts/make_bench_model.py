"""Writes an HF model directory shaped like SmolLM2-135M (random weights, a word-level tokenizer of the
same vocabulary size) for benchmarks on machines where the embedded GGUF cannot travel (the GPU check);
with `--qwen3-moe`, a mixture of experts shaped like Qwen3-30B-A3B scaled down to this CPU (its 128
experts, 8 per token, normalized top-k weights; a quarter of its widths, 6 of its 48 layers).

    python3 scripts/make_bench_model.py OUT_DIR [--qwen3-moe]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 49152


def _smollm2_shaped() -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def _qwen3_moe() -> PreTrainedModel:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen3MoeForCausalLM(config)


def main(out: Path, moe: bool = False) -> None:
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    ).save_pretrained(out)
    torch.manual_seed(0)
    model = _qwen3_moe() if moe else _smollm2_shaped()
    model.to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--qwen3-moe" in sys.argv[2:])
