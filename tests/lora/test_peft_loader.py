"""Reading PEFT adapter files: malformed adapters (unreadable files, wrong types, non-finite weights, regex
pattern keys) are each one `LoRAAdapterError` naming the file and what is wrong, never another exception
(which the server answered with a 500); module-name pattern keys keep PEFT's meaning."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pagedllm.lora.peft_loader import LoRAAdapterError, load_peft_adapter

PREFIX = "base_model.model.model.layers.0"
Q_A = f"{PREFIX}.self_attn.q_proj.lora_A.weight"
Q_B = f"{PREFIX}.self_attn.q_proj.lora_B.weight"
DOWN_A = f"{PREFIX}.mlp.down_proj.lora_A.weight"
DOWN_B = f"{PREFIX}.mlp.down_proj.lora_B.weight"


def _tensors(rank: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shapes = {Q_A: (rank, 16), Q_B: (16, rank), DOWN_A: (rank, 32), DOWN_B: (16, rank)}
    return {key: torch.randn(shape) for key, shape in shapes.items()}


def _adapter(
    path: Path, config: Any = None, tensors: dict[str, torch.Tensor] | None = None, raw: bytes | None = None
) -> Path:
    path.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8} if config is None else config
    text = (
        config
        if isinstance(config, bytes)
        else (config if isinstance(config, str) else json.dumps(config)).encode()
    )
    (path / "adapter_config.json").write_bytes(text)
    weights = path / "adapter_model.safetensors"
    if raw is not None:
        weights.write_bytes(raw)
    else:
        save_file(_tensors() if tensors is None else tensors, str(weights))
    return path


def _valid_bytes(tmp_path: Path) -> bytes:
    return (_adapter(tmp_path / "valid") / "adapter_model.safetensors").read_bytes()


def _with(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**_tensors(), key: value}


CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
# name -> (how to build the adapter under a directory, the file named in the error, what the error says)
MALFORMED: dict[str, tuple[Callable[[Path, bytes], Path], str, str]] = {
    "config-not-json": (lambda p, _: _adapter(p, "{not json"), "adapter_config.json", "not valid JSON"),
    "config-a-list": (lambda p, _: _adapter(p, "[1, 2]"), "adapter_config.json", "not a JSON object"),
    "config-not-utf8": (lambda p, _: _adapter(p, b"\xff{}"), "adapter_config.json", "not valid JSON"),
    "weights-truncated": (
        lambda p, good: _adapter(p, raw=good[: len(good) // 2]),
        "adapter_model.safetensors",
        "cannot be read",
    ),
    "weights-garbage": (
        lambda p, _: _adapter(p, raw=b"\xff" * 64),
        "adapter_model.safetensors",
        "cannot be read",
    ),
    "weights-huge-header": (
        lambda p, _: _adapter(p, raw=(2**62).to_bytes(8, "little") + b"{}"),
        "adapter_model.safetensors",
        "cannot be read",
    ),
    "alpha-a-string": (lambda p, _: _adapter(p, {**CONFIG, "lora_alpha": "x"}), "", "lora_alpha 'x'"),
    "rslora-a-string": (lambda p, _: _adapter(p, {**CONFIG, "use_rslora": "yes"}), "", "use_rslora='yes'"),
    "pattern-a-list": (lambda p, _: _adapter(p, {**CONFIG, "alpha_pattern": [1]}), "", "alpha_pattern=[1]"),
    "rank-zero": (
        lambda p, _: _adapter(p, tensors=_with(Q_A, torch.zeros(0, 16))),
        "",
        f"{Q_A} has shape (0, 16)",
    ),
    "vector-weight": (
        lambda p, _: _adapter(p, tensors=_with(Q_A, torch.ones(16))),
        "",
        f"{Q_A} has shape (16,)",
    ),
    "integer-weight": (
        lambda p, _: _adapter(p, tensors=_with(Q_B, torch.ones(16, 4, dtype=torch.int32))),
        "",
        f"{Q_B} holds torch.int32",
    ),
    "nan-weights": (
        lambda p, _: _adapter(p, tensors=_with(DOWN_B, torch.full((16, 4), float("nan")))),
        "",
        f"{DOWN_B} holds NaN or infinite values",
    ),
    "inf-weight": (
        lambda p, _: _adapter(
            p, tensors=_with(Q_A, torch.ones(4, 16).index_fill(1, torch.tensor([3]), float("inf")))
        ),
        "",
        f"{Q_A} holds NaN or infinite values",
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_adapter_is_refused_naming_file_and_field(tmp_path: Path, name: str) -> None:
    build, file, what = MALFORMED[name]
    path = build(tmp_path / name, _valid_bytes(tmp_path))
    with pytest.raises(LoRAAdapterError) as error:
        load_peft_adapter(path)
    message = str(error.value)
    assert str(path / file) in message and what in message, message


def test_pattern_keys_match_module_names_literally(tmp_path: Path) -> None:
    config = {**CONFIG, "alpha_pattern": {"mlp.down_proj": 2, "q_proj": 16}, "rank_pattern": {"down_proj": 4}}
    adapter = load_peft_adapter(_adapter(tmp_path / "ok", config))
    tensors = _tensors()
    # B is scaled by alpha / r: 16 / 4 for q_proj, 2 / 4 for down_proj (dotted suffixes, as PEFT matches them).
    q = adapter.modules["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(q.b, tensors[Q_B] * 4.0)
    down = adapter.modules["model.layers.0.mlp.down_proj"]
    torch.testing.assert_close(down.b, tensors[DOWN_B] * 0.5)
    # A suffix that is not a whole module-name part does not match ("proj" in PEFT's regex neither).
    partial = load_peft_adapter(_adapter(tmp_path / "partial", {**CONFIG, "alpha_pattern": {"proj": 100}}))
    torch.testing.assert_close(partial.modules["model.layers.0.mlp.down_proj"].b, tensors[DOWN_B] * 2.0)


def test_regex_pattern_key_is_refused_at_once(tmp_path: Path) -> None:
    # `re.match(r"(.*\.)?((.*.*.*.*.*.*)*z)$", module)` backtracks for hours on a module name.
    path = _adapter(tmp_path / "redos", {**CONFIG, "alpha_pattern": {"(.*.*.*.*.*.*.*.*)*z": 1}})
    start = time.monotonic()
    with pytest.raises(LoRAAdapterError, match="alpha_pattern key .* is a regular expression"):
        load_peft_adapter(path)
    assert time.monotonic() - start < 5
