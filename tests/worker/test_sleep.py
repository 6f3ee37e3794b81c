"""Sleep mode returns memory to the OS (the process RSS drops by the KV pool at level 1, by the KV pool
and the weights at level 2) and wakes up to the same outputs; a sleeping engine refuses requests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.engine.utility import EngineSleepingError

# Narrow layers with wide KV heads: 16 KiB of KV cache per token for little compute, so a 128-block
# pool (2048 tokens) is 32 MiB and short prompts fill it quickly.
CONFIG = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=128)
BLOCK_SIZE, NUM_BLOCKS, PROMPT_LEN = 16, 128, 128  # prompts of whole blocks (8 each)
GREEDY = SamplingParams(max_tokens=16, temperature=0)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = make_tiny_llm(tmp_path_factory.mktemp("sleep"), **CONFIG)
    return LLM(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        enforce_eager=True,
        enable_sleep_mode=True,
    )


def _fill_kv_pool(llm: LLM) -> None:
    """Touch every block of the (lazily mapped) pool: more whole-block prompts than it holds."""
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 300 + 3 for j in range(PROMPT_LEN)]}
        for i in range(NUM_BLOCKS * BLOCK_SIZE // PROMPT_LEN + 1)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)


def _kv_pool_bytes(llm: LLM) -> int:
    [spec] = llm.collective_rpc("get_kv_cache_spec")
    return int(spec.bytes_per_block * NUM_BLOCKS)


def _weights_bytes(llm: LLM) -> int:
    return int(llm.collective_rpc(lambda worker: worker.runner.weights_bytes())[0])


def test_sleep_returns_memory_and_wakes_to_the_same_outputs(llm: LLM) -> None:
    kv, weights = _kv_pool_bytes(llm), _weights_bytes(llm)
    assert kv == 32 * 2**20 and weights > 2 * 2**20
    before = llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    _fill_kv_pool(llm)
    resident = rss_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert resident - rss_bytes() >= kv
    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before

    _fill_kv_pool(llm)
    resident = rss_bytes()
    llm.sleep(level=2)
    assert resident - rss_bytes() >= kv + weights
    # Weights first (a trainer could push new ones now), then the cache.
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_sleeping_engine_refuses_requests(llm: LLM) -> None:
    llm.sleep(level=1)
    try:
        with pytest.raises(EngineSleepingError, match="wake_up"):
            llm.generate(["Hello"], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="already sleeping"):
            llm.sleep(level=1)
        # A request that reaches the core anyway (not through LLM.generate) is refused there.
        llm.llm_engine.add_request("direct", "Hello", GREEDY)
        with pytest.raises(ValueError, match="EngineSleepingError"):
            llm.llm_engine.step()
    finally:
        llm.wake_up()
    assert llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].finished


def test_sleep_needs_an_idle_engine_and_a_valid_level(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(tags=["cpu"])
    llm.llm_engine.add_request("busy", "Hello", GREEDY)
    try:
        with pytest.raises(ValueError, match="needs an idle engine: 1 requests"):
            llm.sleep(level=1)
    finally:
        llm.llm_engine.abort_request("busy")
    assert not llm.is_sleeping()
