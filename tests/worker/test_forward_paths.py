"""The runner's choice of way per step (native-c, compiled, eager): by step class, counted, and each
(path, step class) logged once at debug level; and which native body O0 keeps."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagedllm.worker.forward_paths import ForwardPaths, invariant_body


class _Native:
    max_rows = 2

    def __init__(self) -> None:
        self.declines = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        return None if self.declines else torch.full((input_ids.shape[0], 1), 7.0)

    def release(self) -> None:
        pass

    def runs_every_step(self, bound: bool) -> bool:
        return self.max_rows > 2


def _step(paths: ForwardPaths, n: int) -> object:
    return paths(torch.zeros(n, dtype=torch.int64), torch.arange(n))


def _logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode path")]


def test_native_serves_its_step_class_and_the_graphs_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    native = _Native()
    graphs: list[int] = []

    def compiled(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        graphs.append(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], 1)

    paths = ForwardPaths(compiled, lambda: native, lambda n: "1 tokens" if n == 1 else "2..64 tokens")
    with caplog.at_level(logging.DEBUG, logger="pagedllm.worker"):
        assert float(_step(paths, 1)[0, 0]) == 7.0  # type: ignore[index]
        for n in (2, 1, 5, 9):
            _step(paths, n)
        # A step the native body declines (an active adapter, a prompt row) runs the graphs.
        native.declines = True
        _step(paths, 1)
        _step(paths, 2)
    assert graphs == [5, 9, 1, 2]
    assert paths.steps == {"native-c": 3, "compiled": 4}
    assert _logged(caplog) == [
        "decode path: native-c for steps of 1..2 tokens",
        "decode path: compiled for steps of 2..64 tokens",
        "decode path: compiled for steps of 1 tokens",
    ]


def test_without_graphs_every_step_is_eager(caplog: pytest.LogCaptureFixture) -> None:
    paths = ForwardPaths(lambda ids, pos: ids, lambda: None, None)
    with caplog.at_level(logging.DEBUG, logger="pagedllm.worker"):
        for n in (1, 3, 40):
            _step(paths, n)
    assert paths.steps == {"eager": 3}
    assert _logged(caplog) == ["decode path: eager for steps of any size"]


class _WithNative(nn.Module):
    def __init__(self, native: _Native | None) -> None:
        super().__init__()
        self.native = native

    def native_decoder(self) -> _Native | None:
        return self.native


def test_o0_keeps_only_a_native_body_that_runs_every_step() -> None:
    # A body that runs every step (bfloat16 batch invariance) serves O0 too; a decode-rows shortcut, a
    # model without a native path, or one whose path declines the loaded model, leaves O0 eager.
    every = _Native()
    every.max_rows = 1 << 62
    assert invariant_body(_WithNative(every)) is every
    assert invariant_body(_WithNative(_Native())) is None
    assert invariant_body(_WithNative(None)) is None
    assert invariant_body(nn.Linear(2, 2)) is None
