"""Test helper: the embedded SmolLM2 model's perplexity on a fixed English text (2,104 tokens,
data/perplexity_text.txt, written for these tests), for comparisons of execution paths."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from attention.paged_batch import PagedBatch

from pagedllm.formats.gguf_metadata import hf_config_from_gguf, read_gguf_header
from pagedllm.layers.quant.gguf import GGUFQuantizationConfig
from pagedllm.models import load_model
from pagedllm.tokenizer import get_tokenizer


@functools.cache
def _text_ids(gguf_path: Path) -> list[int]:
    # pagedllm's GGUF tokenizer (the same as AutoTokenizer's, tests/test_tokenizer.py) and once per
    # session: AutoTokenizer(gguf_file=...) parses every GGUF field, ~6 s quiet (~45 s on busy cores).
    text = (Path(__file__).parent / "data" / "perplexity_text.txt").read_text()
    ids = get_tokenizer(gguf_path.parent, gguf_file=gguf_path.name).encode(text)
    assert len(ids) >= 2000
    return ids


@functools.cache  # the unquantized 1024-token-step reference serves the fp8 KV and the GGUF tests
def smollm2_perplexity(
    gguf_path: Path,
    quant_config: GGUFQuantizationConfig | None,
    step: int,
    cache_dtype: torch.dtype | None = None,
) -> float:
    """The embedded SmolLM2 model's perplexity on a fixed English text (2,104 tokens, written for
    these tests), fed in steps of `step` tokens through a paged cache of `cache_dtype` (default:
    the model's dtype)."""
    ids = _text_ids(gguf_path)
    config = hf_config_from_gguf(read_gguf_header(gguf_path))
    model = load_model(config, gguf_path.parent, gguf_file=gguf_path.name, quant_config=quant_config)
    batch = PagedBatch.for_model(model, num_blocks=len(ids) // 16 + 2, cache_dtype=cache_dtype)
    logprobs = []
    for start in range(0, len(ids) - 1, step):
        chunk = ids[start : min(start + step, len(ids) - 1)]
        (logits,) = batch.run(model, [("r", chunk)])
        targets = torch.tensor(ids[start + 1 : start + 1 + len(chunk)])
        logprobs.append(torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]))
    return float(torch.exp(-torch.cat(logprobs).mean()))
