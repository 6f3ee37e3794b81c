"""Executor selection and the in-process executor driving one worker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
from runner_driver import RunnerDriver, hf_greedy, make_config, save_tiny_model  # noqa: E402

from pagedllm.config.parallel import EXECUTOR_SUPPORTS_ASYNC  # noqa: E402
from pagedllm.executor import Executor  # noqa: E402
from pagedllm.executor.uniproc import UniProcExecutor  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_get_class_uni(model_dir: Path) -> None:
    cfg = make_config(model_dir)
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    assert Executor.get_class(cfg) is UniProcExecutor


def test_get_class_multi_rank(model_dir: Path) -> None:
    from pagedllm.executor.external_launcher import ExternalLauncherExecutor
    from pagedllm.executor.multiproc import MultiprocExecutor
    from pagedllm.executor.ray import RayExecutor

    cfg = make_config(model_dir)
    cfg.parallel_config.distributed_executor_backend = "mp"
    assert Executor.get_class(cfg) is MultiprocExecutor
    cfg.parallel_config.distributed_executor_backend = "ray"
    assert Executor.get_class(cfg) is RayExecutor
    cfg.parallel_config.distributed_executor_backend = "external_launcher"
    assert Executor.get_class(cfg) is ExternalLauncherExecutor
    with pytest.raises(ValueError, match="needs a launcher .torchrun. to start"):
        ExternalLauncherExecutor(cfg)


def test_async_support_agrees_with_config_table() -> None:
    # The config reads the table without importing executors; both must say the same.
    assert UniProcExecutor.supports_async_scheduling() is EXECUTOR_SUPPORTS_ASYNC["uni"]


def test_uniproc_executor_runs_the_model(model_dir: Path) -> None:
    executor = UniProcExecutor(make_config(model_dir, optimization_level=0, kv_cache_memory_bytes=2**20))
    [spec] = executor.collective_rpc("get_kv_cache_spec")
    assert executor.collective_rpc("determine_available_kv_cache_bytes") == [2**20]
    assert executor.collective_rpc("initialize_kv_cache", args=(2**20 // spec.bytes_per_block,)) == [None]
    driver = RunnerDriver(executor, num_blocks=2**20 // spec.bytes_per_block)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    driver.add("r", prompt, 6)
    assert driver.run()["r"] == hf_greedy(model_dir, prompt, 6)
    assert executor.collective_rpc("propose_draft_token_ids") == [None]
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc("get_kv_cache_spec")


def test_collective_rpc_passes_arguments_by_name(model_dir: Path) -> None:
    """Methods run by name on the worker, with positional and keyword arguments."""
    executor = UniProcExecutor(make_config(model_dir, optimization_level=0, kv_cache_memory_bytes=2**20))
    executor.collective_rpc("initialize_kv_cache", kwargs={"num_blocks": 7})
    assert executor.collective_rpc("__getattribute__", args=("model_runner",))[0].num_blocks == 7
    with pytest.raises(AttributeError, match="no_such_method"):
        executor.collective_rpc("no_such_method")
    executor.shutdown()
