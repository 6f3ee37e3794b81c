"""`pagedllm bench startup`: seconds from launching `pagedllm serve` to the first request served.

Each run starts a fresh server process on a free port with the given serve arguments, polls `/health`,
sends one completion, and stops the server. The compile cache lives under `--cache-root` (a fresh
temporary directory by default), so the first run is cold and the following ones are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("startup", help="Time from `pagedllm serve` to the first request served.")
    parser.add_argument("--runs", type=int, default=2, help="Server starts; the first is cold.")
    parser.add_argument(
        "--cache-root",
        default=None,
        help="PAGEDLLM_CACHE_ROOT of the servers (compile and tokenizer caches); default: a fresh "
        "temporary directory.",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds to wait for each server.")
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="Arguments for `pagedllm serve` (after a `--`)."
    )
    return parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def time_one_start(serve_args: list[str], env: dict[str, str], timeout: float) -> dict[str, float]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *serve_args, "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=timeout) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with status {proc.returncode} while starting")
                if time.perf_counter() - start > timeout:
                    raise TimeoutError(f"the server was not healthy after {timeout:.0f} s")
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            healthy = time.perf_counter() - start
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
            reply = client.post(
                f"{base}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 8}
            )
            reply.raise_for_status()
            served = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"healthy_s": healthy, "first_request_served_s": served}


def run(args: argparse.Namespace) -> int:
    serve_args = [a for a in args.serve_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="pagedllm-startup-") as tmp:
        # The compile cache and the tokenizer cache both live under it: empty on a cold run.
        env = {**os.environ, "PAGEDLLM_CACHE_ROOT": args.cache_root or tmp}
        runs = []
        for i in range(args.runs):
            result = time_one_start(serve_args, env, args.timeout)
            kind = "cold" if i == 0 and args.cache_root is None else "warm"
            print(
                f"run {i + 1} ({kind}): healthy after {result['healthy_s']:.1f} s, "
                f"first request served after {result['first_request_served_s']:.1f} s"
            )
            runs.append({"kind": kind, **result})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"serve_args": serve_args, "runs": runs}, f, indent=2)
    return 0
