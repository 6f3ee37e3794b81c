"""The torch profiler through `LLM.start_profile()/stop_profile()`: one Chrome trace per run, named after
the engine instance, that loads as JSON and names the model's ops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.worker.profiler import TorchProfiler


def test_profile_writes_a_chrome_trace(tmp_path: Path) -> None:
    model = make_tiny_llm(tmp_path / "model")
    trace_dir = tmp_path / "traces"
    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        profiler_config={"profiler": "torch", "torch_profiler_dir": str(trace_dir)},
    )
    with pytest.raises(ValueError, match="not running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(ValueError, match="already running"):
        llm.start_profile()
    llm.generate(["Hello world"], SamplingParams(max_tokens=4), use_tqdm=False)
    [trace] = llm.stop_profile()
    assert Path(trace).parent == trace_dir
    assert Path(trace).name.startswith(f"pagedllm-{llm.llm_engine.engine_config.instance_id}-rank0.")
    events = json.loads(Path(trace).read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert names & {"aten::linear", "aten::mm", "aten::addmm"}
    assert "aten::embedding" in names
    # A second run writes a second file.
    llm.start_profile()
    assert llm.stop_profile() != [trace]
    assert len(list(trace_dir.iterdir())) == 2


def test_profiling_not_configured(tmp_path: Path) -> None:
    llm = LLM(model=str(make_tiny_llm(tmp_path)), dtype="float32", max_model_len=128, enforce_eager=True)
    with pytest.raises(ValueError, match="profiling is not configured"):
        llm.start_profile()


def test_trace_names_carry_the_data_parallel_rank(tmp_path: Path) -> None:
    # Every data parallel core of one server writes to the same directory: its rank keeps them apart.
    assert TorchProfiler(str(tmp_path), "abc", 0, dp_rank=1).worker_name == "pagedllm-abc-dp1-rank0"
    assert TorchProfiler(str(tmp_path), "abc", 0).worker_name == "pagedllm-abc-rank0"
