"""`pagedllm bench throughput|latency|startup` end to end on a tiny model: the figures they report are
consistent with the workload (token counts, ratios against the HF baseline measured beside them), not
timed here (timings live in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from tiny_llm import make_tiny_llm

from pagedllm.attention.backends.protocol import StepClass

ENGINE = ["-O0", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_throughput_with_hf_baseline(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    args = ["--num-prompts", "6", "--input-len", "8..40", "--output-len", "5", "--baseline", "hf"]
    result = bench(
        "throughput",
        "--model",
        str(model_dir),
        *ENGINE,
        *args,
        "--hf-dtypes",
        "float32",
        "--hf-batch-size",
        "4",
        "--output-json",
        str(out),
    )
    report = json.loads(out.read_text())
    assert report["num_requests"] == 6 and report["dtype"] == "float32"
    # Every request generates exactly output-len tokens (ignore_eos), on both sides.
    assert report["output_tokens_per_s"] * report["elapsed_s"] == pytest.approx(30)
    (hf,) = report["baselines"]
    assert hf["dtype"] == "float32" and hf["num_output_tokens"] == 30
    assert hf["num_input_tokens"] == round(report["input_tokens_per_s"] * report["elapsed_s"])
    assert report["ratio_vs_best_hf"] == pytest.approx(
        report["total_tokens_per_s"] / hf["total_tokens_per_s"]
    )
    assert 0 < report["fraction_of_compute_roofline"]
    assert "ratio vs best HF" in result.stdout


def test_latency_with_hf_baseline(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    args = [
        "--batch-size",
        "2",
        "--input-len",
        "24",
        "--output-len",
        "6",
        "--num-iters",
        "2",
        "--baseline",
        "hf",
    ]
    result = bench(
        "latency",
        "--model",
        str(model_dir),
        *ENGINE,
        *args,
        "--hf-dtypes",
        "float32",
        "--output-json",
        str(out),
    )
    report = json.loads(out.read_text())
    assert report["prefill_tokens_per_s"] == pytest.approx(48 / report["prefill_s_median"])
    # -O0: every measured step (2 iterations of a prompt step and 5 decode steps) ran the eager module.
    assert report["decode_paths"] == {"eager": 12}
    assert "decode path: eager (12 steps)" in result.stdout
    # The backend each attention step class runs on (`pagedllm.attention.backends.hybrid`), named.
    backends = report["attention_backends"]
    assert set(backends) == {step.value for step in StepClass} and all(backends.values())
    assert f"attention backends: {StepClass.FEW_DECODES.value}: {backends[StepClass.FEW_DECODES.value][0]}" in result.stdout
    steps = report["decode_step_ms"]
    assert 0 < steps["p50"] <= steps["p90"] <= steps["p99"]
    # The engine process after load holds at least the torch runtime (a few hundred MiB).
    assert 100 < report["rss_after_load_mib"] < psutil.virtual_memory().total / 2**20
    (hf,) = report["baselines"]
    assert hf["prefill_ratio"] == pytest.approx(report["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"])
    assert hf["decode_ratio"] == pytest.approx(report["decode_tokens_per_s"] / hf["decode_tokens_per_s"])


def test_latency_of_the_prompt_step_alone(model_dir: Path, tmp_path: Path) -> None:
    """--output-len 1: the prompt step emits the only token; no decode figures, no crash."""
    out = tmp_path / "latency.json"
    args = ["--batch-size", "1", "--input-len", "16", "--output-len", "1", "--num-iters", "1", "--baseline", "hf"]
    result = bench("latency", "--model", str(model_dir), *ENGINE, *args, "--hf-dtypes", "float32", "--output-json", str(out))
    report = json.loads(out.read_text())
    assert report["prefill_tokens_per_s"] == pytest.approx(16 / report["prefill_s_median"])
    assert report["decode_step_ms"] is None and report["decode_tokens_per_s"] is None
    (hf,) = report["baselines"]
    assert hf["decode_ratio"] is None and hf["prefill_ratio"] > 0
    assert "no decode steps" in result.stdout


def _processes_with(variable: str, value: str) -> list[psutil.Process]:
    """The running processes whose environment has `variable=value` (inherited by every descendant of
    the process it was set for, so a server the machine's other users run is never counted)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(variable) == value and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def test_startup_serves_a_request_and_stops_the_server(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    marker = uuid.uuid4().hex
    env = {**os.environ, "BENCH_STARTUP_TEST_MARKER": marker}
    serve_args = ["--model", str(model_dir), *ENGINE]
    bench("startup", "--runs", "1", "--output-json", str(out), "--", *serve_args, env=env)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["kind"] == "cold" and 0 < run["healthy_s"] <= run["first_request_served_s"]
    # The server and its engine process are gone (a loaded machine may take a moment to reap them).
    _, leftover = psutil.wait_procs(_processes_with("BENCH_STARTUP_TEST_MARKER", marker), timeout=30)
    assert leftover == []


def test_throughput_json_workload_runs_constrained_and_not(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "json.json"
    engine = [*ENGINE, "--max-model-len", "512"]  # the prompts carry their schema: ~500 tiny tokens
    args = ["--dataset", "json", "--num-prompts", "4", "--output-len", "6", "--output-json", str(out)]
    result = bench("throughput", "--model", str(model_dir), *engine, *args)
    report = json.loads(out.read_text())
    structured = report["structured_outputs"]
    constrained, unconstrained = structured["constrained"], structured["unconstrained"]
    # The unconstrained run computes exactly the constrained run's tokens: only the grammar differs.
    assert constrained["num_output_tokens"] == unconstrained["num_output_tokens"] > 0
    assert constrained["num_input_tokens"] == unconstrained["num_input_tokens"]
    assert report["output_tokens_per_s"] == pytest.approx(
        constrained["num_output_tokens"] / constrained["elapsed"]
    )
    assert structured["ratio_constrained_vs_unconstrained"] == pytest.approx(
        constrained["total_tokens_per_s"] / unconstrained["total_tokens_per_s"]
    )
    compile_report = structured["compile"]
    assert compile_report["backend"] == "xgrammar" and len(compile_report["schemas"]) == 4
    for entry in compile_report["schemas"]:
        assert 0 < entry["cached_s"] < entry["cold_s"]
    assert "structured outputs: constrained" in result.stdout
