"""KV cache block arithmetic: bytes per block over mixed layers, blocks from a byte budget, and the
clear error when one full-length sequence does not fit."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kv_cache_interface import KVCacheSpec, check_num_blocks, num_blocks_from_budget


def test_bytes_per_block() -> None:
    spec = KVCacheSpec(block_size=16, num_kv_heads=[3] * 30, head_size=[64] * 30, dtype=torch.bfloat16)
    # SmolLM2-135M: 30 layers x (K, V) x 16 tokens x 3 heads x 64 x 2 bytes.
    assert spec.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 2
    mixed = KVCacheSpec(block_size=8, num_kv_heads=[2, 4], head_size=[16, 8], dtype=torch.float32)
    assert mixed.bytes_per_block == 8 * 4 * (2 * 2 * 16 + 2 * 4 * 8)


def test_num_blocks_from_budget() -> None:
    assert num_blocks_from_budget(10_000, 3_000, None) == 3
    assert num_blocks_from_budget(10_000, 3_000, 17) == 17


def test_check_num_blocks() -> None:
    check_num_blocks(8, 16, 128, 1000)
    check_num_blocks(8, 16, 113, 1000)
    with pytest.raises(ValueError, match=r"holds 7 blocks.*max_model_len=128 sequence needs 8 blocks"):
        check_num_blocks(7, 16, 128, 1000)
