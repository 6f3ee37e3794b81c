"""The GGUF header reader: metadata and tensor offsets without the tokenizer arrays' contents."""

from __future__ import annotations

from pathlib import Path

from pagedllm.formats.gguf_metadata import SkippedArray, read_gguf_header


def test_gguf_header_skips_tokenizer_arrays(smollm2_gguf: Path) -> None:
    header = read_gguf_header(smollm2_gguf)
    tokens = header.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, SkippedArray) and tokens.count == 49152
    assert len(header.tensor_names) == 272 and "output.weight" not in header.tensor_names
