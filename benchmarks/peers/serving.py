"""(D) Serving: `pagedllm serve` and `vllm serve` on the same HF directory, each driven by vLLM's own
client, `vllm bench serve --backend openai --dataset-name random ... --ignore-eos` (same seed, so the
same prompts), one server at a time, alternating per repeat like the offline workloads."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from peers.runner import ENGINE_DIR, ENGINES, Settings, stop_group

SERVERS = ("pagedllm", "vllm")
# Percentile keys of `vllm bench serve --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99`.
KEPT = (
    "completed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _vllm_cli(s: Settings) -> list[str]:
    return [str(ENGINES["vllm"].python(s.peers_dir)), str(ENGINE_DIR / "vllm_cli.py")]


def server_command(
    engine: str, model: Path, port: int, max_model_len: int, s: Settings, extra: dict[str, Any]
) -> list[str]:
    common = [
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        s.dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--seed",
        "0",
    ]
    common += option_flags(extra)
    if engine == "pagedllm":
        kv = ["--kv-cache-memory-bytes", str(s.kv_cache_gib * 2**30)]
        return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *common, *kv]
    return [*_vllm_cli(s), "serve", *common]  # the KV budget is VLLM_CPU_KVCACHE_SPACE


def option_flags(options: dict[str, Any]) -> list[str]:
    """{"max_num_batched_tokens": 2048, "enforce_eager": true} -> --max-num-batched-tokens 2048 --enforce-eager."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        else:
            flags += [flag, value if isinstance(value, str) else json.dumps(value)]
    return flags


def client_command(model: Path, port: int, args: Any, result_dir: Path, name: str) -> list[str]:
    return [
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--ignore-eos",
        "--seed",
        str(args.seed),
        "--num-warmups",
        "2",
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        name,
    ]


def _wait_ready(proc: subprocess.Popen, port: int, timeout_s: float) -> str | None:
    """None once GET /v1/models answers 200; else why not (the server exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited {proc.returncode} before it was ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(2)
    return f"server not ready after {timeout_s:.0f} s"


def run_server(engine: str, model: Path, args: Any, s: Settings, tag: str) -> dict[str, Any]:
    """Start one server, run vLLM's client against it, stop the server; the client's figures."""
    port = _free_port()
    spec = ENGINES[engine]
    env = spec.env(s)
    server_log, client_log = s.log_dir / f"{tag}.server.log", s.log_dir / f"{tag}.client.log"
    max_model_len = args.input_len + args.output_len + 16
    cmd = server_command(engine, model, port, max_model_len, s, getattr(args, f"{engine}_args"))
    start = time.monotonic()
    with open(server_log, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        error = _wait_ready(server, port, s.timeout_s)
        if error:
            return {"ok": False, "error": f"{error}; log: {server_log}"}
        load_s = time.monotonic() - start
        name = f"{tag}.client.json"
        client_env = ENGINES["vllm"].env(s)
        with open(client_log, "w") as log:
            client = subprocess.run(
                [*_vllm_cli(s), *client_command(model, port, args, s.log_dir, name)],
                env=client_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=s.timeout_s,
                start_new_session=True,
            )
        result_file = s.log_dir / name
        if client.returncode != 0 or not result_file.exists():
            return {"ok": False, "error": f"vllm bench serve exited {client.returncode}; log: {client_log}"}
        figures = json.loads(result_file.read_text())
        if figures.get("completed") != args.num_prompts:
            return {"ok": False, "error": f"{figures.get('completed')} of {args.num_prompts} requests completed"}
        return {
            "ok": True,
            "load_s": load_s,
            **{k: figures.get(k) for k in KEPT},
            "flags": {"server_command": " ".join(cmd)},
            "version": _version(engine, s),
            "notes": [],
        }
    finally:
        stop_group(server)


def _version(engine: str, s: Settings) -> dict[str, str]:
    spec = ENGINES[engine]
    package = "pagedllm" if engine == "pagedllm" else "vllm"
    out = subprocess.run(
        [str(spec.python(s.peers_dir)), "-c", f"import {package}; print({package}.__version__)"],
        env=spec.env(s),
        capture_output=True,
        text=True,
    )
    return {package: out.stdout.strip() or "unknown"}


def server_engines(names: str | None, peers_dir: Path) -> tuple[list[str], list[str]]:
    wanted = names.split(",") if names else list(SERVERS)
    bad = [n for n in wanted if n not in SERVERS]
    if bad:
        raise SystemExit(f"--engines for serve: {bad} not servers; choose from {list(SERVERS)}")
    skipped = [r for r in (ENGINES[n].unavailable(peers_dir) for n in wanted) if r]
    if ENGINES["vllm"].unavailable(peers_dir):
        raise SystemExit(f"serve needs vLLM's client: {ENGINES['vllm'].unavailable(peers_dir)}")
    chosen = [n for n in wanted if not ENGINES[n].unavailable(peers_dir)]
    return sorted(chosen, key=lambda n: n != "pagedllm"), skipped
