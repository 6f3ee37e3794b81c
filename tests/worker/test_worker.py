"""Worker: device set-up, seeding and delegation to its runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_driver import RunnerDriver, hf_greedy, make_config, save_tiny_model

from pagedllm.worker.worker import Worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_worker_seeds_and_runs(model_dir: Path) -> None:
    worker = Worker(make_config(model_dir, optimization_level=0, kv_cache_memory_bytes=2**20))
    with pytest.raises(RuntimeError, match="init_device"):
        worker.load_model()
    worker.init_device()
    seeded = torch.rand(4)
    torch.manual_seed(worker.engine_config.model_config.seed)
    assert torch.equal(seeded, torch.rand(4))
    worker.load_model()
    num_blocks = worker.determine_available_kv_cache_bytes() // worker.get_kv_cache_spec().bytes_per_block
    worker.initialize_kv_cache(num_blocks)
    driver = RunnerDriver(worker, num_blocks=num_blocks)
    driver.add("r", [1, 2, 3, 4], 5)
    assert driver.run()["r"] == hf_greedy(model_dir, [1, 2, 3, 4], 5)
    worker.shutdown()
    assert worker.model_runner is None
