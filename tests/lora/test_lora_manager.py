"""The worker's adapter bookkeeping on a loaded tiny model: PEFT files read and checked (clear errors
for what is not served), the in-memory LRU, slots, and the native decode path stepping aside."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft_adapters import SPECS, AdapterSpec, make_adapter, make_adapters, make_base

from pagedllm.config import LoRAConfig
from pagedllm.forward_context import set_forward_context
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.peft_loader import LoRAAdapterError
from pagedllm.lora.request import LoRARequest
from pagedllm.models import load_model
from pagedllm.models.native import llama_decode


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tmp_path_factory.mktemp("lora-files"))


def _model(files: dict[str, Path]) -> torch.nn.Module:
    from transformers import AutoConfig

    return load_model(AutoConfig.from_pretrained(files["base"]), files["base"])


def _manager(files: dict[str, Path], model: torch.nn.Module | None = None, **config: int) -> LoRAManager:
    model = model if model is not None else _model(files)
    return LoRAManager(
        model, LoRAConfig(**config), max_num_tokens=64, max_num_reqs=4, model_dtype=torch.float32
    )


def _req(files: dict[str, Path], name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(files[name]))


def test_lru_keeps_max_cpu_loras(files: dict[str, Path]) -> None:
    m = _manager(files, max_loras=1, max_cpu_loras=2, max_lora_rank=16)
    assert m.add_adapter(_req(files, "qv8", 1)) and m.add_adapter(_req(files, "all4-rs", 2))
    assert not m.add_adapter(_req(files, "qv8", 1))  # already there: now the most recently used
    m.add_adapter(_req(files, "mlp16", 3))
    assert m.list_adapters() == [1, 3]  # 2 was the least recently used
    assert m.add_adapter(_req(files, "all4-rs", 2))  # read again from its files
    assert m.remove_adapter(2) and not m.remove_adapter(2)


def test_slots(files: dict[str, Path]) -> None:
    m = _manager(files, max_loras=2, max_cpu_loras=3, max_lora_rank=16)
    m.add_request(0, _req(files, "qv8", 1))
    m.add_request(1, None)
    m.add_request(2, _req(files, "mlp16", 3))
    m.set_step(np.array([2, 0, 1]), np.array([3, 1, 2]))
    mask = m.state.mask[:6]
    assert mask.tolist() == [[0, 1]] * 3 + [[1, 0]] + [[0, 0]] * 2 and m.state.active
    with pytest.raises(RuntimeError, match="max_loras"):
        m.add_request(3, _req(files, "all4-rs", 2))
    m.remove_request(0)
    m.add_request(3, _req(files, "all4-rs", 2))  # takes the slot adapter 1 no longer uses
    assert m.slot_lora == [2, 3] and m.remove_adapter(1)
    m.set_step(np.array([1]), np.array([4]))
    assert not m.state.active and not m.state.mask[:4].any()


def test_bad_adapters_are_refused_by_name(files: dict[str, Path], tmp_path: Path) -> None:
    m = _manager(files, max_loras=1, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="rank 16, above max_lora_rank=8"):
        m.add_adapter(_req(files, "mlp16", 1))
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        m.add_adapter(LoRARequest("missing", 2, str(tmp_path / "nowhere")))
    # An adapter trained on another base (wider hidden size): the shapes do not match.
    other = make_base("qwen2", tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    (other / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**cfg)).save_pretrained(other)
    make_adapter(other, tmp_path / "mismatch", SPECS["qv8"], 0)
    with pytest.raises(LoRAAdapterError, match="does not match the base model"):
        m.add_adapter(LoRARequest("mismatch", 3, str(tmp_path / "mismatch")))
    # Trained embeddings / LM head.
    make_adapter(
        files["base"],
        tmp_path / "saves",
        AdapterSpec(4, ["q_proj"], extra={"modules_to_save": ["lm_head"]}),
        0,
    )
    with pytest.raises(LoRAAdapterError, match="modules_to_save"):
        m.add_adapter(LoRARequest("saves", 4, str(tmp_path / "saves")))
    make_adapter(files["base"], tmp_path / "emb", AdapterSpec(4, ["embed_tokens", "q_proj"]), 0)
    with pytest.raises(LoRAAdapterError, match="embed_tokens|embeddings"):
        m.add_adapter(LoRARequest("emb", 5, str(tmp_path / "emb")))
    assert m.list_adapters() == []


def test_native_decode_steps_aside_for_an_active_adapter(files: dict[str, Path]) -> None:
    model = _model(files)
    m = _manager(files, model, max_loras=1, max_lora_rank=16)
    # The LoRA-wrapped projections still expose their base weight: the native path accepts the model
    # (for base-model steps) ...
    assert llama_decode._unsupported(model) is None
    # ... and returns None (the graphs run the step) whenever a token of the step runs an adapter.
    decoder = object.__new__(llama_decode.LlamaNativeDecoder)
    decoder.max_rows = 8
    decoder.projection_methods = [p.quant_method for p in llama_decode._projections(model.model.layers[0])]

    def bind() -> bool:
        raise AssertionError("a step with an active adapter must not reach the native call")

    decoder._bind = bind  # type: ignore[method-assign]
    m.add_request(0, _req(files, "qv8", 1))
    m.set_step(np.array([0]), np.array([1]))
    with set_forward_context(object()):  # type: ignore[arg-type]
        assert decoder(torch.tensor([5]), torch.tensor([3])) is None
