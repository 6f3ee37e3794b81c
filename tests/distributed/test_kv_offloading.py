"""The offloading tier (kv_offloading_size, backend native): a primary pool too small for the working
set; re-requested prefixes come back from the tier, their prefill is skipped, outputs do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
from kv_engines import BLOCK_SIZE, generate, make_llm, random_prompts
from tiny_llm import make_tiny_llm

# 6 prompts of 60 tokens: 3 full blocks each (18 blocks), far more than a primary pool of 8 keeps.
PROMPTS = random_prompts(6, 60)
FULL_BLOCKS = 60 // BLOCK_SIZE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("offload") / "m")


@pytest.fixture(scope="module")
def unbounded(model_dir: Path) -> list[list[int]]:
    llm, _ = make_llm(model_dir, num_gpu_blocks_override=64)
    return generate(llm, PROMPTS)


def test_tier_serves_evicted_prefixes(model_dir: Path, unbounded: list[list[int]]) -> None:
    llm, counted = make_llm(model_dir, num_gpu_blocks_override=8, kv_offloading_size=0.01)
    assert generate(llm, PROMPTS) == unbounded
    first = counted.scheduled_tokens
    assert counted.external_hits == 0
    # Second round: every prompt's full blocks were evicted from the 8-block pool, into the tier.
    assert generate(llm, PROMPTS) == unbounded
    hit_tokens = len(PROMPTS) * FULL_BLOCKS * BLOCK_SIZE
    assert counted.external_hits == hit_tokens
    # Only the prompts' tails (and the decodes) ran: the loaded tokens' prefill was skipped.
    assert counted.scheduled_tokens - first == first - hit_tokens
    assert counted.stats["bytes_loaded"] > 0 and counted.stats["bytes_saved"] > 0


def test_small_tier_evicts_its_own_blocks(model_dir: Path, unbounded: list[list[int]]) -> None:
    # A tier of 4 blocks: it keeps the most recently evicted ones, evicting its own oldest.
    bytes_per_block = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4  # layers x (k, v) x kv heads x tokens x head dim x fp32
    llm, counted = make_llm(
        model_dir, num_gpu_blocks_override=8, kv_offloading_size=4 * bytes_per_block / 2**30
    )
    assert generate(llm, PROMPTS + PROMPTS[::-1]) == unbounded + unbounded[::-1]
    assert 0 < counted.external_hits < len(PROMPTS) * FULL_BLOCKS * BLOCK_SIZE
