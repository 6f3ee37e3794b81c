"""Where a KV connector's copies run (`BackgroundJobs`): inline on the CPU, on a thread of their own where
the platform copies beside the forward; either way in order, and a failure surfaces at `wait`."""

from __future__ import annotations

import threading

import pytest

from pagedllm.distributed.kv_transfer.base import BackgroundJobs
from pagedllm.platforms import current_platform


@pytest.mark.parametrize("background", [False, True])
def test_jobs_run_in_order_and_fail_at_wait(background: bool) -> None:
    jobs = BackgroundJobs("test", background)
    ran: list[tuple[int, bool]] = []
    caller = threading.get_ident()

    def job(i: int) -> None:
        ran.append((i, threading.get_ident() == caller))

    def failing() -> None:
        raise RuntimeError("copy failed")

    try:
        jobs.submit(lambda: job(0))
        jobs.submit(failing)
        jobs.submit(lambda: job(1))
        if not background:
            # Inline: done before submit returns, in the caller's thread.
            assert ran == [(0, True), (1, True)]
        with pytest.raises(RuntimeError, match="copy failed"):
            jobs.wait()
        assert [i for i, _ in ran] == [0, 1]
        assert all(in_caller != background for _, in_caller in ran)
        jobs.wait()  # the failure was reported once; nothing is pending
    finally:
        jobs.shutdown()


def test_cpu_copies_run_inline() -> None:
    if current_platform.device_type != "cpu":
        pytest.skip("the CPU platform's choice")
    assert not current_platform.supports_background_kv_copies()
