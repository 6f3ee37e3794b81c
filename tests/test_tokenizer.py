"""get_tokenizer: the GGUF tokenizer equals transformers' own GGUF loading, its disk cache, HF dirs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, trainers
from transformers import AutoTokenizer

from pagedllm.tokenizer import get_tokenizer, resolve_chat_template

TEXTS = [
    "Hello world! How are you?",
    "  spaces\tand\nnewlines\n\n",
    "你好，世界 😀🚀 café naïve",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x**2  # 42",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(smollm2_gguf: Path, cache_dir: Path) -> None:
    ours = get_tokenizer(smollm2_gguf, cache_dir=cache_dir)
    ref = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert len(ours) == len(ref) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.chat_template == ref.chat_template and "<|im_start|>" in ours.chat_template
    for text in TEXTS:
        for add_special in (True, False):
            assert ours.encode(text, add_special_tokens=add_special) == ref.encode(
                text, add_special_tokens=add_special
            )
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_gguf_cache_is_written_and_reused(smollm2_gguf: Path, tmp_path: Path) -> None:
    first = get_tokenizer(smollm2_gguf, cache_dir=tmp_path)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and sorted(f.name for f in entries[0].iterdir()) == [
        "tokenizer.json",
        "tokenizer_kwargs.json",
    ]
    # A second load reads the cache: prove it by tampering with the cached chat template.
    kwargs_file = entries[0] / "tokenizer_kwargs.json"
    kwargs_file.write_text(kwargs_file.read_text().replace("<|im_start|>", "<|IM_START|>"))
    second = get_tokenizer(smollm2_gguf, cache_dir=tmp_path)
    assert "<|IM_START|>" in second.chat_template and "<|IM_START|>" not in first.chat_template
    for text in TEXTS:
        assert second.encode(text) == first.encode(text)
    assert second.eos_token == first.eos_token == "<|im_end|>"


def test_gguf_file_inside_a_directory(smollm2_gguf: Path, cache_dir: Path) -> None:
    tok = get_tokenizer(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, cache_dir=cache_dir)
    assert tok.encode("Hello") == get_tokenizer(smollm2_gguf, cache_dir=cache_dir).encode("Hello")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        get_tokenizer(smollm2_gguf.parent, gguf_file="missing.gguf", cache_dir=cache_dir)


def test_hf_directory_and_model_config(smollm2_gguf: Path, cache_dir: Path, tmp_path: Path) -> None:
    gguf_tok = get_tokenizer(smollm2_gguf, cache_dir=cache_dir)
    gguf_tok.save_pretrained(tmp_path)
    hf_tok = get_tokenizer(tmp_path)
    assert hf_tok.chat_template == gguf_tok.chat_template
    for text in TEXTS:
        assert hf_tok.encode(text) == gguf_tok.encode(text)
    config = SimpleNamespace(
        tokenizer=str(tmp_path),
        tokenizer_mode="auto",
        trust_remote_code=False,
        tokenizer_revision=None,
        skip_tokenizer_init=False,
    )
    assert get_tokenizer(config).encode("Hello world") == gguf_tok.encode("Hello world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skip_tokenizer_init is set"):
        get_tokenizer(SimpleNamespace(**{**vars(config), "skip_tokenizer_init": True}))  # type: ignore[arg-type]


def test_unsupported_modes(smollm2_gguf: Path, cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer_mode='slow' is not supported for GGUF"):
        get_tokenizer(smollm2_gguf, tokenizer_mode="slow", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="tokenizer_mode='mistral' is not supported"):
        get_tokenizer(smollm2_gguf, tokenizer_mode="mistral", cache_dir=cache_dir)


def test_resolve_chat_template(smollm2_gguf: Path, cache_dir: Path, tmp_path: Path) -> None:
    tok = get_tokenizer(smollm2_gguf, cache_dir=cache_dir)
    assert resolve_chat_template(tok) == tok.chat_template
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert resolve_chat_template(tok, inline) == inline
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert resolve_chat_template(tok, path) == inline and resolve_chat_template(tok, str(path)) == inline
    with pytest.raises(ValueError, match="is neither a template nor a file"):
        resolve_chat_template(tok, str(tmp_path / "missing.jinja"))


def _write_llama_gguf(path: Path) -> None:
    """A tiny GGUF with a SentencePiece ("llama") byte-fallback vocabulary that asks for BOS."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you?", "你好，世界。"] * 5
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    learned = trained.get_vocab()
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [t for t in sorted(learned, key=learned.__getitem__) if t not in tokens]
    merges = [
        m if isinstance(m, str) else " ".join(m) for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    # llama.cpp token types: 1 normal, 2 unknown, 3 control, 6 byte.
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_with_bos_matches_transformers(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.gguf"
    _write_llama_gguf(path)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    fresh = get_tokenizer(path, cache_dir=tmp_path / "cache")
    cached = get_tokenizer(path, cache_dir=tmp_path / "cache")
    for text in ["Hello world!", "你好 🚀 fox", "  two  spaces", "</s> and <s> inside"]:
        ids = ref.encode(text)
        assert ids[0] == 1  # BOS, as the file asks
        assert fresh.encode(text) == cached.encode(text) == ids
        for skip in (True, False):
            assert cached.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert cached.chat_template == ref.chat_template
