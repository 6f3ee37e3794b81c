"""Runtime directories: a dead process's are removed when a new one is made; a live process's, another
user's, a link, or a name that is not ours never are."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from pagedllm import runtime_dir
from pagedllm.runtime_dir import make_runtime_dir, remove_stale_runtime_dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not psutil.pid_exists(proc.pid)
    return proc.pid


def test_only_dead_processes_dirs_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"pagedllm-{_dead_pid()}-ipc-abc"
    (dead / "sub").mkdir(parents=True)
    (dead / "input").write_text("")
    live = tmp_path / f"pagedllm-{os.getpid()}-ipc-def"
    live.mkdir()
    # pid 1 started long before this directory was written: its owner is alive.
    init = tmp_path / "pagedllm-1-rendezvous-ghi"
    init.mkdir()
    # A directory written before its pid's process started: the pid was reused, the owner is gone.
    reused = tmp_path / f"pagedllm-{os.getpid()}-ipc-old"
    reused.mkdir()
    os.utime(reused, (0, 0))
    other_names = [tmp_path / "pagedllm-kgorgb8u", tmp_path / "pagedllm-server-abc.log", tmp_path / "other"]
    for path in other_names[::2]:
        path.mkdir()
    other_names[1].write_text("")
    link = tmp_path / f"pagedllm-{_dead_pid()}-ipc-link"
    link.symlink_to(tmp_path / "other")

    assert sorted(remove_stale_runtime_dirs(tmp_path)) == sorted([dead, reused])
    assert not dead.exists() and not reused.exists()
    assert all(p.exists() for p in (live, init, link, *other_names))


def test_another_users_dir_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = tmp_path / f"pagedllm-{_dead_pid()}-ipc-abc"
    dead.mkdir()
    other_uid = os.getuid() + 1
    monkeypatch.setattr(runtime_dir.os, "getuid", lambda: other_uid)
    assert remove_stale_runtime_dirs(tmp_path) == [] and dead.exists()


def test_a_new_dir_is_private_and_sweeps_the_stale_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"pagedllm-{_dead_pid()}-ipc-abc"
    stale.mkdir()
    made = Path(make_runtime_dir("ipc"))
    assert made.parent == tmp_path and made.name.startswith(f"pagedllm-{os.getpid()}-ipc-")
    assert made.stat().st_mode & 0o777 == 0o700
    assert not stale.exists()
    assert remove_stale_runtime_dirs(tmp_path) == [] and made.exists()
