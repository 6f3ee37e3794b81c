"""The roofline probes: best-of timing with a time floor, and the better of two readings."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest

from pagedllm.benchmarks import roofline
from pagedllm.benchmarks.roofline import Roofline, _best_seconds


def _timed_calls(
    monkeypatch: pytest.MonkeyPatch, durations: list[float]
) -> tuple[list[int], Callable[[], None]]:
    """A fake clock for the probe and a function whose calls advance it by the next of `durations`;
    returns ([number of calls so far], the function). The probe's first call is its warm-up."""
    clock, calls, times = [0.0], [0], iter(durations)
    monkeypatch.setattr(roofline, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fn() -> None:
        calls[0] += 1
        clock[0] += next(times)

    return calls, fn


def test_best_seconds_keeps_the_fastest_call_after_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, fn = _timed_calls(monkeypatch, [0.001, 0.5, 0.2, 0.3, 0.1])
    assert _best_seconds(fn, repeats=3) == pytest.approx(0.2)  # not the warm-up's 0.001
    assert calls[0] == 4


def test_best_seconds_repeats_until_min_seconds_have_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, fn = _timed_calls(monkeypatch, [0.5] + [0.03125] * 100)
    _best_seconds(fn, repeats=2, min_seconds=0.125)
    assert calls[0] == 1 + 4  # 4 timed calls of 1/32 s reach 1/8 s; 2 would not


def test_best_keeps_the_higher_reading_of_each_limit() -> None:
    a, b = Roofline(bandwidth=30e9, matmul_rate=0.2e12), Roofline(bandwidth=25e9, matmul_rate=0.4e12)
    assert a.best(b) == Roofline(30e9, 0.4e12) == b.best(a)
    assert a.best(b).compute_tokens_per_s(100_000_000) == pytest.approx(0.4e12 / 2e8)
