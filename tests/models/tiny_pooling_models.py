"""Tiny random pooling models saved as HF directories: BERT encoders (with a WordPiece tokenizer, and
optionally sentence-transformers' modules.json + Pooling config) and a BERT cross-encoder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    PreTrainedModel,
)

_WORDS = (
    "the quick brown fox jumps over lazy dog paged attention stores keys and values in blocks "
    "continuous batching mixes prefills decodes one step hello world how are you today i am fine "
    "thank what is a cat sat on mat embeddings retrieval search query document passage ranks best"
).split()
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_config(**overrides: Any) -> BertConfig:
    values: dict[str, Any] = dict(
        vocab_size=len(_SPECIAL) + len(_WORDS) + 32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    values.update(overrides)
    return BertConfig(**values)


def save_tokenizer(path: Path) -> BertTokenizerFast:
    path.mkdir(parents=True, exist_ok=True)
    vocab = path / "vocab.txt"
    vocab.write_text(
        "\n".join(
            _SPECIAL
            + _WORDS
            + [chr(c) for c in range(ord("a"), ord("z") + 1)]
            + ["?", "!", ".", ",", ":", "'"]
        )
        + "\n"
    )
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    tokenizer.save_pretrained(path)
    return tokenizer


def _randomize(model: PreTrainedModel, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)


def write_sentence_transformers_modules(path: Path, pooling: str, normalize: bool, hidden_size: int) -> None:
    """modules.json (Transformer -> Pooling [-> Normalize]) and the Pooling module's config."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": hidden_size,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": pooling == "lasttoken",
                "include_prompt": True,
            }
        )
    )
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 128, "do_lower_case": False})
    )


def make_tiny_bert(
    path: Path, pooling: str | None = "mean", normalize: bool = True, seed: int = 0, **config: Any
) -> BertModel:
    """A random BertModel + tokenizer at `path`; with `pooling`, also sentence-transformers' modules."""
    save_tokenizer(path)
    cfg = bert_config(**config)
    model = BertModel(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    if pooling is not None:
        write_sentence_transformers_modules(path, pooling, normalize, cfg.hidden_size)
    return model


def make_tiny_cross_encoder(path: Path, num_labels: int = 1, seed: int = 0) -> BertForSequenceClassification:
    save_tokenizer(path)
    model = BertForSequenceClassification(bert_config(num_labels=num_labels)).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return model
