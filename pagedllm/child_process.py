"""How the server's child processes (engine cores, workers) start and stop.

SIGTERM and SIGINT go to the whole process group: systemd's default `KillMode=control-group`, `docker
stop` on an init process, Ctrl-C in a terminal. They are the API server's to act on: it drains the
requests in flight, then stops its engine cores, which stop their workers. So the children ignore both,
from their first instruction on (the parent holds the signals while it starts one, and the child inherits
them held until `init_child_process` ignores them), and follow their parent instead: a core exits when
its parent stops it or dies, a worker when its core tells it to or dies (`PR_SET_PDEATHSIG`).

Children leave with `os._exit` (an interpreter teardown can wait seconds on library threads), which skips
`multiprocessing`'s finalizers: a named semaphore created in a child would outlive it, and the resource
tracker warns of it ("leaked semaphore objects") when the server stops.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker

GROUP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def group_signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT in this thread while a child process starts: the child inherits them held,
    so a group signal during its start-up cannot kill it before `init_child_process`; this process gets
    its own copy once the child is started."""
    # A spawned child needs multiprocessing's resource tracker, and starting it unblocks both signals
    # (it blocks them around its own launch, then unblocks rather than restores): start it first.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_group_signals() -> None:
    """Ignore SIGTERM and SIGINT, dropping any that arrived while they were held."""
    for signum in GROUP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)


def init_child_process() -> None:
    """First thing in a child process: ignore SIGTERM and SIGINT (`ignore_group_signals`), and give
    tqdm's progress bars (torch.compile draws them) a thread lock: by default tqdm creates a
    `multiprocessing` lock, a named semaphore that `os._exit` would leak."""
    ignore_group_signals()
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux `PR_SET_PDEATHSIG`), so no child is
    ever orphaned; elsewhere the parent's shutdown is the only cleanup. (Under `forkserver` the parent is
    the fork server, which exits with the engine process.)"""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # the parent died before the signal was armed
        os._exit(1)
