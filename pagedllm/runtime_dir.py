"""Private directories of a running process under the temp directory: the ZMQ sockets between the API
server and its engine core, the `mp` executor's rendezvous file.

Each is created mode 0700 and named `pagedllm-<pid>-<purpose>-<random>`. A process killed with SIGKILL
never removes its own, so every new one first removes the stale ones: ours (owned by this user, a
directory and not a link) whose process is gone, or whose pid now belongs to a process started after
the directory was last written (the pid was reused). Another user's or a live process's are never
touched.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import psutil

_NAME = re.compile(r"pagedllm-(\d+)-[a-z]+-[^/]+")
# A process's start time is known to about a second (the boot time's resolution): a directory written
# within this of its start is taken as its own.
_START_TIME_SLACK_S = 2.0


def make_runtime_dir(purpose: str) -> str:
    """A new private directory of this process (after removing the stale ones)."""
    remove_stale_runtime_dirs()
    return tempfile.mkdtemp(prefix=f"pagedllm-{os.getpid()}-{purpose}-")


def _owner_alive(pid: int, written_at: float) -> bool:
    try:
        return psutil.Process(pid).create_time() <= written_at + _START_TIME_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to inspect: leave it
        return True


def remove_stale_runtime_dirs(root: Path | None = None) -> list[Path]:
    """Remove this user's runtime directories whose process is gone; the ones removed."""
    removed = []
    for entry in Path(root or tempfile.gettempdir()).glob("pagedllm-*"):
        match = _NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if not _owner_alive(int(match[1]), info.st_mtime):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
