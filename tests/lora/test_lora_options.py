"""LoRA's user-facing options: vLLM's flat flags, the request type, and the server's --lora-modules."""

from __future__ import annotations

import pytest

from pagedllm.config.args import EngineArgs
from pagedllm.entrypoints.openai.serving_lora import LoRAModulePath, parse_lora_module
from pagedllm.lora.request import LoRARequest, lora_per_prompt


def test_flat_flags_build_lora_config() -> None:
    cfg = EngineArgs(
        enable_lora=True, max_loras=3, max_lora_rank=32, lora_dtype="float32"
    ).create_engine_config()
    lc = cfg.lora_config
    assert lc is not None and (lc.max_loras, lc.max_cpu_loras, lc.max_lora_rank, lc.lora_dtype) == (
        3,
        3,
        32,
        "float32",
    )
    assert EngineArgs().create_engine_config().lora_config is None
    with pytest.raises(ValueError, match="max_loras needs enable_lora"):
        EngineArgs(max_loras=2).create_engine_config()
    with pytest.raises(ValueError, match="fully_sharded_loras"):
        EngineArgs(enable_lora=True, fully_sharded_loras=True).create_engine_config()
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).create_engine_config()


def test_lora_request_and_per_prompt() -> None:
    a = LoRARequest("a", 1, "/a")
    assert lora_per_prompt(a, 3) == [a, a, a] and lora_per_prompt(None, 2) is None
    assert lora_per_prompt([a, None], 2) == [a, None]
    with pytest.raises(ValueError, match="2 lora_request entries for 3 prompts"):
        lora_per_prompt([a, None], 3)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/a")
    with pytest.raises(ValueError, match="lora_path is required"):
        LoRARequest("a", 1)


def test_lora_modules_forms() -> None:
    assert parse_lora_module("sql=/x/sql") == LoRAModulePath("sql", "/x/sql")
    json_form = '{"name": "chat", "path": "/x/chat", "base_model_name": "base"}'
    assert parse_lora_module(json_form) == LoRAModulePath("chat", "/x/chat", "base")
    for bad in ("sql", "=/x", '{"name": "a"}', '{"name": "a", "path": "/p", "rank": 3}', "{oops"):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_module(bad)
