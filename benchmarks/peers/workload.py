"""The model a peer run measures (read from its files, engine-independent) and the jobs handed to every
engine: token-id prompts drawn once from a fixed seed, so each engine runs exactly the same ids."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.datasets import random_requests

# Weights of at least this many parameters take issue 40's 1B workload sizes (fewer, shorter requests).
LARGE_MODEL_PARAMS = 500_000_000
# Bytes per element of the dtypes a dense model runs in.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_SAFETENSORS_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class ModelFacts:
    path: Path
    kind: str  # "hf" (a directory of safetensors) or "gguf" (one file)
    vocab_size: int
    special_ids: tuple[int, ...]
    num_params: int
    # Elements of the weights one single-sequence decode step reads: every tensor once, the token
    # embedding only where it is also the LM head (a step gathers one row of it otherwise).
    step_elements: int
    # The same weights' bytes as the file stores them (GGUF blocks with their scales).
    step_stored_bytes: int

    @property
    def large(self) -> bool:
        return self.num_params >= LARGE_MODEL_PARAMS

    def step_bytes(self, dtype: str, stored: bool) -> int:
        """Bytes a decode step reads: as stored (an engine executing GGUF blocks) or densely in `dtype`."""
        return self.step_stored_bytes if stored else self.step_elements * DTYPE_BYTES[dtype]


def read_model(path: Path) -> ModelFacts:
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf(path)
    if (path / "config.json").is_file():
        return _read_hf(path)
    raise SystemExit(f"--model {path}: neither a .gguf file nor an HF directory with config.json")


def _safetensors_header(file: Path) -> dict[str, Any]:
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _read_hf(path: Path) -> ModelFacts:
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)
    shapes: dict[str, list[int]] = {}
    stored = 0
    for file in sorted(path.glob("*.safetensors")):
        for name, info in _safetensors_header(file).items():
            shapes[name] = info["shape"]
            stored += math.prod(info["shape"]) * _SAFETENSORS_BYTES.get(info["dtype"], 2)
    if not shapes:
        raise SystemExit(f"--model {path}: no safetensors weights")
    elements = {name: math.prod(shape) for name, shape in shapes.items()}
    embed = next((n for n in elements if n.endswith("embed_tokens.weight")), None)
    has_head = any(n.endswith("lm_head.weight") for n in elements)
    gathered = elements[embed] if embed is not None and has_head else 0
    stored_gathered = gathered * (stored / max(sum(elements.values()), 1))
    return ModelFacts(
        path=path,
        kind="hf",
        vocab_size=int(config["vocab_size"]),
        special_ids=_hf_special_ids(path),
        num_params=sum(elements.values()),
        step_elements=sum(elements.values()) - gathered,
        step_stored_bytes=int(stored - stored_gathered),
    )


def _hf_special_ids(path: Path) -> tuple[int, ...]:
    """Ids of the tokenizer's special tokens (tokenizer.json's added tokens marked special)."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return ()
    added = json.loads(file.read_text()).get("added_tokens", [])
    return tuple(sorted(t["id"] for t in added if t.get("special")))


def _read_gguf(path: Path) -> ModelFacts:
    from gguf import GGUFReader, TokenType

    reader = GGUFReader(path)
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    special = tuple(i for i, t in enumerate(types) if t == TokenType.CONTROL)
    tensors = {t.name: t for t in reader.tensors}
    gathered = tensors["token_embd.weight"] if "output.weight" in tensors else None
    num_params = sum(int(t.n_elements) for t in tensors.values())
    stored = sum(int(t.n_bytes) for t in tensors.values())
    return ModelFacts(
        path=path,
        kind="gguf",
        vocab_size=len(types),
        special_ids=special,
        num_params=num_params,
        step_elements=num_params - (int(gathered.n_elements) if gathered is not None else 0),
        step_stored_bytes=stored - (int(gathered.n_bytes) if gathered is not None else 0),
    )


def _prompts(model: ModelFacts, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    requests = random_requests(count, lengths, 1, model.vocab_size, seed, model.special_ids)
    return [r.prompt_token_ids for r in requests]  # type: ignore[misc]


def offline_job(model: ModelFacts, num_prompts: int, input_len: tuple[int, int], output_len: int, seed: int) -> dict:
    """(A) `num_prompts` prompts of lengths drawn from `input_len`; the warm-up is 4 other prompts."""
    return {
        "workload": "offline",
        "prompts": _prompts(model, num_prompts, input_len, seed),
        "output_len": output_len,
        "warmup_prompts": _prompts(model, 4, input_len, seed + 1),
        "warmup_output_len": min(8, output_len),  # within max_model_len
        "max_model_len": input_len[1] + output_len,
    }


def decode_job(model: ModelFacts, input_len: int, output_len: int, iters: int, seed: int) -> dict:
    """(B) A warm-up prompt and `iters` pairs of distinct prompts of `input_len` tokens."""
    prompts = _prompts(model, 1 + 2 * iters, (input_len, input_len), seed)
    return {
        "workload": "decode",
        "warmup_prompt": prompts[0],
        "prompt_pairs": [prompts[1 + 2 * i : 3 + 2 * i] for i in range(iters)],
        "output_len": output_len,
        "max_model_len": input_len + output_len,
    }


def prefill_job(model: ModelFacts, lengths: list[int], iters: int, seed: int) -> dict:
    """(C) Per length, a warm-up prompt and `iters` timed ones, all distinct."""
    by_length = {}
    for i, length in enumerate(lengths):
        prompts = _prompts(model, 1 + iters, (length, length), seed + i)
        by_length[str(length)] = {"warmup": prompts[0], "timed": prompts[1:]}
    return {"workload": "prefill", "prompts_by_length": by_length, "max_model_len": max(lengths) + 16}
