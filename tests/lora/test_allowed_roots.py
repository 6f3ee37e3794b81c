"""`--lora-allowed-roots`: adapters are read only from under the roots; `..` and links that leave them
are refused naming `lora_path` (checked on plain directories: no model needed), and the worker's
manager applies it to every adapter it reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from peft_adapters import make_adapters

from pagedllm.config import LoRAConfig
from pagedllm.config.args import EngineArgs
from pagedllm.errors import RequestError
from pagedllm.lora.allowed_roots import check_adapter_path
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest


def _adapter(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_text("")
    return path


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """An allowed root holding one adapter, and an adapter outside it."""
    root, outside = tmp_path / "allowed", tmp_path / "outside"
    _adapter(root / "good")
    _adapter(outside / "secret")
    return root, outside


def test_paths_under_the_roots_pass(roots: tuple[Path, Path]) -> None:
    root, outside = roots
    assert check_adapter_path(str(root / "good"), [str(root)]) == str(root / "good")
    assert check_adapter_path(str(root / "sub" / ".." / "good"), [str(root)])  # `..` that stays inside
    assert check_adapter_path(str(outside / "secret"), None)  # no roots: anything the server reads
    assert check_adapter_path(str(outside / "secret"), [str(root), str(outside)])


def test_paths_leaving_the_roots_are_refused(roots: tuple[Path, Path]) -> None:
    root, outside = roots
    (root / "link").symlink_to(outside / "secret", target_is_directory=True)
    linked_files = _adapter(root / "files")
    (linked_files / "adapter_model.safetensors").unlink()
    (linked_files / "adapter_model.safetensors").symlink_to(outside / "secret" / "adapter_model.safetensors")
    for path in (
        outside / "secret",
        root / ".." / "outside" / "secret",
        root / "link",
        linked_files,
        Path("/etc"),
        Path("relative/adapter"),
    ):
        with pytest.raises(RequestError, match="--lora-allowed-roots") as info:
            check_adapter_path(str(path), [str(root)])
        assert info.value.param == "lora_path"


def test_the_flag_builds_the_config(roots: tuple[Path, Path]) -> None:
    root, outside = roots
    cfg = EngineArgs(enable_lora=True, lora_allowed_roots=[str(root), str(outside)]).create_engine_config()
    assert cfg.lora_config is not None and cfg.lora_config.lora_allowed_roots == [str(root), str(outside)]
    with pytest.raises(ValueError, match="lora_allowed_roots: .* is not a directory"):
        LoRAConfig(lora_allowed_roots=[str(root / "missing")])


def test_the_manager_reads_only_under_the_roots(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from pagedllm.models import load_model

    files = make_adapters(tmp_path / "allowed")
    shutil.copytree(files["qv8"], tmp_path / "elsewhere")
    model = load_model(AutoConfig.from_pretrained(files["base"]), files["base"])
    config = LoRAConfig(max_lora_rank=16, lora_allowed_roots=[str(tmp_path / "allowed")])
    manager = LoRAManager(model, config, max_num_tokens=64, max_num_reqs=4, model_dtype=torch.float32)
    assert manager.add_adapter(LoRARequest("qv8", 1, str(files["qv8"])))
    with pytest.raises(RequestError, match="--lora-allowed-roots"):
        manager.add_adapter(LoRARequest("copy", 2, str(tmp_path / "elsewhere")))
    assert manager.list_adapters() == [1]
