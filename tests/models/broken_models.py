"""Test helper: broken copies of a tiny model, as users meet them (an interrupted download, a wrong
config.json, a corrupted or hostile GGUF), each with what its one-line error must name."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from gguf_files import write_llama_gguf
from tiny_llm import make_tiny_llm

GGUF_VOCAB = 384  # the tiny Llama tokenizer's size, so that --tokenizer can point at the tiny model


def _copy(good: Path, path: Path) -> Path:
    shutil.copytree(good, path)
    return path


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def make_broken_models(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (the model path to pass as --model, the strings its error line must contain). The good
    tiny model is `root / "good"`, and its directory serves as the GGUF files' --tokenizer."""
    good = make_tiny_llm(root / "good")
    weights = (good / "model.safetensors").read_bytes()
    cases: dict[str, tuple[Path, list[str]]] = {}

    path = _copy(good, root / "st-truncated")
    (path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    cases["st-truncated"] = (path, [str(path / "model.safetensors"), "offsets out of range"])

    path = _copy(good, root / "st-huge-header")
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + weights[8:])
    cases["st-huge-header"] = (path, [str(path / "model.safetensors"), "corrupt safetensors header"])

    path = _copy(good, root / "shape-mismatch")
    intermediate = json.loads((good / "config.json").read_text())["intermediate_size"]
    _edit_config(path, intermediate_size=intermediate + 16)
    cases["shape-mismatch"] = (path, [str(path), "model.layers.0.mlp", "does not fit the model its config"])

    path = _copy(good, root / "config-not-json")
    (path / "config.json").write_text("{")
    cases["config-not-json"] = (path, [str(path / "config.json"), "not a valid JSON"])

    gguf = write_llama_gguf(root / "good.gguf", {}, vocab=GGUF_VOCAB)
    data = gguf.read_bytes()
    path = root / "gguf-truncated.gguf"
    path.write_bytes(data[: len(data) * 2 // 3])
    cases["gguf-truncated"] = (path, [str(path), "runs past the end of the file"])

    path = root / "gguf-huge-tensor-count.gguf"
    path.write_bytes(data[:8] + struct.pack("<Q", 2**62) + data[16:])
    cases["gguf-huge-tensor-count"] = (path, [str(path), f"claims {2**62} tensors"])

    path = root / "gguf-huge-metadata-count.gguf"
    path.write_bytes(data[:16] + struct.pack("<Q", 2**62) + data[24:])
    cases["gguf-huge-metadata-count"] = (path, [str(path), f"claims {2**62} metadata entries"])

    path = root / "gguf-garbage.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 4092)
    cases["gguf-garbage"] = (path, [str(path), "unknown GGUF version"])
    return cases
