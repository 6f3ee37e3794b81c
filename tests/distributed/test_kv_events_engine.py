"""KV cache events from a running EngineCore (tiny random Llama): after requests with shared prefixes,
evictions from a small pool and a prefix-cache reset, the blocks a vLLM subscriber believes cached are
exactly the engine's, and every batch arrived once, numbered without gaps."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from kv_event_subscriber import BlockRemoved, BlockStored, Subscriber, cached_hashes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
from runner_driver import TINY, save_tiny_model  # noqa: E402

from pagedllm.config.cache import CacheConfig  # noqa: E402
from pagedllm.config.engine import EngineConfig  # noqa: E402
from pagedllm.config.kv_transfer import KVEventsConfig  # noqa: E402
from pagedllm.config.model import ModelConfig  # noqa: E402
from pagedllm.config.scheduler import SchedulerConfig  # noqa: E402
from pagedllm.core.kv_events import external_block_hash  # noqa: E402
from pagedllm.engine.core import EngineCore  # noqa: E402
from pagedllm.engine.protocol import EngineCoreRequest  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

BS = 16
SYSTEM = list(range(1, 2 * BS + 1))  # two full blocks every request shares


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_engine_events_match_the_prefix_cache(model_dir: Path, tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    config = EngineConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
        # 10 blocks: the prompts below need far more over the run, so cached blocks get evicted.
        cache_config=CacheConfig(block_size=BS, num_gpu_blocks_override=10),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, topic="kv-events"
        ),
        optimization_level=0,
    )
    core = EngineCore(config)
    sub = Subscriber(endpoint, "kv-events", replay)
    try:
        time.sleep(0.3)  # let the SUB socket join before the first batch
        pool = core.scheduler.kv_cache_manager.block_pool
        received: list = []
        for wave in range(4):
            for i in range(3):
                tail = [(wave * 31 + i * 7 + k) % TINY["vocab_size"] for k in range(BS + 5 * i)]
                sp = SamplingParams(temperature=0.0, max_tokens=6)
                core.add_request(EngineCoreRequest(f"w{wave}-{i}", SYSTEM + tail, sp, eos_token_id=None))
            while core.has_unfinished_requests():
                core.step()
            received += sub.receive(idle_timeout_s=0.5)
            engine_cached = {external_block_hash(h) for h in pool.cached_block_hash_to_block}
            assert engine_cached and cached_hashes([b for _, b in received]) == engine_cached
        assert core.reset_prefix_cache()
        received += sub.receive(idle_timeout_s=0.5)
        batches = [b for _, b in received]
        assert cached_hashes(batches) == set() and not pool.cached_block_hash_to_block

        assert [seq for seq, _ in received] == list(range(len(received)))
        events = [e for b in batches for e in b.events]
        assert any(isinstance(e, BlockRemoved) for e in events), "the small pool never evicted"
        first = next(e for e in events if isinstance(e, BlockStored))
        assert first.parent_block_hash is None and first.token_ids[: 2 * BS] == SYSTEM
        assert first.medium == "GPU" and first.block_size == BS and first.lora_id is None
        # The replay endpoint returns the same stream to a subscriber that missed it.
        assert sub.request_replay(0) == received
    finally:
        sub.close()
        core.shutdown()
