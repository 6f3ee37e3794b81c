"""Compiled execution (optimization levels O1-O3 and every compilation mode): the same greedy tokens as
eager on a workload of mixed prefill/decode steps, one graph per shape class, and a warm second start
that loads every graph from the on-disk cache."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from runner_driver import RunnerDriver, hf_greedy, make_config, save_tiny_model

from pagedllm.attention.backends.torch_paged import TorchPagedAttentionBackend
from pagedllm.config import CompilationConfig, CompilationMode, EngineConfig, KernelConfig
from pagedllm.layers import skinny_gemm
from pagedllm.worker.compiled_forward import CompiledForward
from pagedllm.worker.model_runner import ModelRunner

PROMPTS = {"a": list(range(5, 45)), "b": [100, 101, 102], "c": [7 * i % 256 for i in range(1, 30)]}
MAX_TOKENS = 10
# The graphs of the 2..8-token class (first layer and the others) the compiled forward adds where
# the few-row product kernel is built.
FEW_ROW_GRAPHS = 2 if skinny_gemm.available() else 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def hf_tokens(model_dir: Path) -> dict[str, list[int]]:
    return {k: hf_greedy(model_dir, p, MAX_TOKENS) for k, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache for the tests that are not about the cache: a graph another test compiled
    under the same configuration and Inductor options loads from it instead of compiling again (each
    still traces its graphs, and counts and calls them as on a cold start); the warm-start test below
    keeps a cache of its own."""
    return tmp_path_factory.mktemp("shared")


def run_workload(runner: ModelRunner) -> dict[str, list[int]]:
    """Staggered arrivals and 7-token prefill chunks: steps of many different sizes, mixing chunks,
    whole prompts and decodes, and single-request decode steps at the end."""
    driver = RunnerDriver(runner, num_blocks=64, chunk_size=7)
    driver.add("a", PROMPTS["a"], MAX_TOKENS)
    driver.step()
    driver.add("b", PROMPTS["b"], MAX_TOKENS)
    driver.step()
    driver.add("c", PROMPTS["c"], MAX_TOKENS + 6)
    return driver.run()


def make_runner(model_dir: Path, tmp_path: Path, native: bool = False, **fields: Any) -> ModelRunner:
    """A runner over the tiny model, compiled per `fields` (EngineConfig fields), with its compile
    cache under `tmp_path`. Unless `native`, one-token steps run the graphs too (the native decode
    path, which would serve them on this CPU, has its own tests)."""
    base = make_config(model_dir)
    fields.setdefault("compilation_config", CompilationConfig())
    fields["compilation_config"].cache_dir = str(tmp_path / "compile-cache")
    config = EngineConfig(
        model_config=base.model_config,
        scheduler_config=base.scheduler_config,
        cache_config=base.cache_config,
        **fields,
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(64)
    if not native and isinstance(runner._forward, CompiledForward):
        runner._forward.native = None
    return runner


def is_compile_wrapper(fn: Any) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable")


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_every_level_gives_the_greedy_tokens_of_eager(
    level: int, model_dir: Path, hf_tokens: dict[str, list[int]], shared_cache: Path
) -> None:
    runner = make_runner(
        model_dir, shared_cache, native=True, optimization_level=level, compilation_config=CompilationConfig()
    )
    compiled = level > 0
    assert isinstance(runner._forward, CompiledForward) == compiled
    expected = dict(hf_tokens)
    expected["c"] = hf_greedy(model_dir, PROMPTS["c"], MAX_TOKENS + 6)
    assert run_workload(runner) == expected
    if compiled:
        forward = runner._forward
        assert isinstance(forward, CompiledForward)
        # One graph per (shape class, first layer or not) for the classes the workload hits (the steps
        # up to 64 tokens; where decode steps of 1..8 tokens do not run natively, 1 token and 2..8
        # tokens where the few-row kernel is built), plus the single-row LM head: many step sizes, no
        # recompiles.
        graphs = 3 if forward.native is not None else 5 + FEW_ROW_GRAPHS
        assert forward.num_graphs == graphs
        # Every step after a graph's first ran Dynamo's captured bytecode as a plain function, not
        # torch.compile's wrapper (which carries its original callable).
        calls = [*forward._fns.values(), forward._single_row_call]
        assert len(calls) == graphs
        assert all(isinstance(f, types.FunctionType) and not is_compile_wrapper(f) for f in calls)


def test_without_the_bytecode_hook_the_compiled_wrappers_run(
    model_dir: Path, hf_tokens: dict[str, list[int]], shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch._dynamo.convert_frame, "register_bytecode_hook")
    runner = make_runner(model_dir, shared_cache)
    tokens = run_workload(runner)
    assert tokens["a"] == hf_tokens["a"] and tokens["b"] == hf_tokens["b"]
    forward = runner._forward
    assert isinstance(forward, CompiledForward)
    calls = [*forward._fns.values(), forward._single_row_call]
    assert len(calls) == 5 + FEW_ROW_GRAPHS and all(is_compile_wrapper(f) for f in calls)


@pytest.mark.parametrize("mode", [CompilationMode.STOCK_TORCH_COMPILE, CompilationMode.DYNAMO_TRACE_ONCE])
def test_other_compilation_modes(
    mode: CompilationMode, model_dir: Path, hf_tokens: dict[str, list[int]], shared_cache: Path
) -> None:
    runner = make_runner(
        model_dir, shared_cache, compilation_config=CompilationConfig(mode=mode, backend="eager")
    )
    assert isinstance(runner._forward, CompiledForward) and runner._forward.mode == mode
    tokens = run_workload(runner)
    assert tokens["a"] == hf_tokens["a"] and tokens["b"] == hf_tokens["b"]


def test_shape_classes(model_dir: Path, tmp_path: Path) -> None:
    runner = make_runner(
        model_dir,
        tmp_path,
        compilation_config=CompilationConfig(compile_ranges_endpoints=[8], compile_sizes=[4]),
    )
    forward = runner._forward
    assert isinstance(forward, CompiledForward) and forward.range_ends == [8, 64]
    assert [forward.shape_class(n) for n in (1, 2, 4, 8, 9, 64)] == [
        ("size", 1),
        ("range", 0),
        ("size", 4),
        ("range", 0),
        ("range", 1),
        ("range", 1),
    ]
    assert forward._range_bounds(0) == (2, 8) and forward._range_bounds(1) == (9, 64)
    with pytest.raises(ValueError, match="65 tokens exceed the last compile range end 64"):
        forward.shape_class(65)


_WARM_START = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_compiled_forward import make_runner, run_workload
runner = make_runner(Path({model!r}), Path({tmp!r}))
run_workload(runner)
print(json.dumps({{"graphs": runner._forward.num_graphs, "hits": runner._forward.num_cache_hits}}))
"""


def test_warm_start_loads_every_graph_from_the_cache(model_dir: Path, tmp_path: Path) -> None:
    script = _WARM_START.format(tests=str(Path(__file__).parent), model=str(model_dir), tmp=str(tmp_path))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["graphs"] == warm["graphs"] == 5 + FEW_ROW_GRAPHS
    assert cold["hits"] == 0 and warm["hits"] == 5 + FEW_ROW_GRAPHS
    assert any((tmp_path / "compile-cache").iterdir())


@pytest.mark.parametrize("warm_up", [True, False])
def test_warm_up_compiles_every_shape_class_at_start(
    warm_up: bool, model_dir: Path, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[str] = []
    monkeypatch.setattr(TorchPagedAttentionBackend, "warm_up", lambda device: built.append(device.type))
    runner = make_runner(model_dir, shared_cache, kernel_config=KernelConfig(enable_jit_warmup=warm_up))
    runner.compile_or_warm_up_model()
    # The attention backend's native kernel is built at start too.
    assert built == (["cpu"] if warm_up else [])
    forward = runner._forward
    assert isinstance(forward, CompiledForward)
    # Every shape class (first layer and the others) and the single-row LM head, before any request.
    assert forward.num_graphs == (5 + FEW_ROW_GRAPHS if warm_up else 0)
    run_workload(runner)
    assert forward.num_graphs == 5 + FEW_ROW_GRAPHS
