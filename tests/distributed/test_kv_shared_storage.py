"""SharedStorageConnector in one process: a producer engine stores its prompts' blocks in a directory, a
consumer engine with the same model loads them instead of computing their prefill; a corrupt or
missing stored block is recomputed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kv_engines import BLOCK_SIZE, generate, make_llm, random_prompts
from tiny_llm import make_tiny_llm

from pagedllm.distributed.kv_transfer.base import KVConnectorRole
from pagedllm.distributed.kv_transfer.factory import connector_class
from pagedllm.distributed.kv_transfer.multi import MultiConnector
from pagedllm.kv_cache_interface import KVCacheSpec

PROMPTS = random_prompts(3, 60, seed=1)
FULL_BLOCKS = 60 // BLOCK_SIZE


def _config(role: str, path: Path) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("shared") / "m")


def test_consumer_loads_what_the_producer_stored(model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    producer, _ = make_llm(model_dir, kv_transfer_config=_config("kv_producer", store))
    # Prompt 0's first block alone, then its first two: the second run stores exactly block 1.
    generate(producer, [PROMPTS[0][:BLOCK_SIZE]])
    (block0,) = {p.name for p in store.rglob("*.safetensors")}
    generate(producer, [PROMPTS[0][: 2 * BLOCK_SIZE]])
    (block1,) = {p.name for p in store.rglob("*.safetensors")} - {block0}
    expected = generate(producer, PROMPTS)
    files = sorted(store.rglob("*.safetensors"))
    assert len(files) == len(PROMPTS) * FULL_BLOCKS

    consumer, counted = make_llm(model_dir, kv_transfer_config=_config("kv_consumer", store))
    assert generate(consumer, PROMPTS) == expected
    loaded = len(PROMPTS) * FULL_BLOCKS * BLOCK_SIZE
    assert counted.external_hits == loaded
    # The consumer ran only each prompt's last partial block and the decodes.
    decodes = sum(len(o) - 1 for o in expected)
    assert counted.scheduled_tokens == len(PROMPTS) * (60 - FULL_BLOCKS * BLOCK_SIZE) + decodes
    assert counted.stats["bytes_loaded"] > 0 and "bytes_saved" not in counted.stats

    # Corrupt prompt 0's block 1 (one flipped byte in its data) and delete prompt 1's last block.
    path = next(f for f in files if f.name == block1)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    other, counted = make_llm(model_dir, kv_transfer_config=_config("kv_consumer", store))
    assert generate(other, PROMPTS[2:]) == expected[2:]  # (untouched: all of its blocks load)
    before = counted.external_hits
    assert before == FULL_BLOCKS * BLOCK_SIZE
    assert generate(other, PROMPTS[:1]) == expected[:1]
    # Only block 0 of prompt 0 loaded; blocks 1 and 2 (after the corrupt one) were recomputed.
    assert counted.external_hits - before == BLOCK_SIZE


def test_connector_config_errors(tmp_path: Path) -> None:
    engine_config = SimpleNamespace(kv_transfer_config=None)
    spec = KVCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=[2], head_size=[16], dtype=torch.float32)
    role = KVConnectorRole.SCHEDULER
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys.*shared_storage_path"):
        connector_class("SharedStorageConnector")(engine_config, role, spec, {"path": str(tmp_path)})
    with pytest.raises(ValueError, match="connectors must list"):
        MultiConnector(engine_config, role, spec, {})
    with pytest.raises(ValueError, match="NixlConnector.*is not supported"):
        connector_class("NixlConnector")
