"""Child processes started the server's way ignore the process group's SIGTERM and SIGINT, even during
their start-up, and leave no named semaphore behind when they exit with `os._exit` (the resource
tracker's "leaked semaphore objects" warning on every Ctrl-C of a compiled server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import multiprocessing, os, signal, sys, time

from pagedllm.child_process import group_signals_held, init_child_process


def child(conn):
    init_child_process()
    from tqdm import tqdm

    for _ in tqdm(range(3), disable=False):  # torch.compile draws such bars in the engine core
        pass
    conn.send("ready")
    conn.recv()  # the parent's "stop"
    conn.send("stopping")
    os._exit(0)


if __name__ == "__main__":
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    with group_signals_held():
        proc = ctx.Process(target=child, args=(theirs,))
        proc.start()
    # While the child is still starting (a spawned interpreter takes a while to import), and once it runs.
    os.killpg(0, signal.SIGTERM)
    assert ours.poll(120) and ours.recv() == "ready"
    os.killpg(0, signal.SIGINT)
    os.killpg(0, signal.SIGTERM)
    time.sleep(0.5)
    ours.send("stop")
    assert ours.recv() == "stopping"
    proc.join(60)
    print("exit code", proc.exitcode, "signals", sorted(received))
"""


def test_child_ignores_group_signals_and_leaks_no_semaphore(tmp_path: Path) -> None:
    script = tmp_path / "group_signals.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        start_new_session=True,
    )
    assert result.returncode == 0, result.stderr
    # The child survived three group signals and exited on its parent's word; the parent got each signal.
    assert "exit code 0 signals [2, 15, 15]" in result.stdout, (result.stdout, result.stderr)
    assert "leaked semaphore" not in result.stderr, result.stderr
