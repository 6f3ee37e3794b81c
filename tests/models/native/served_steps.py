"""Test helper of the native-path tests: which steps the native body served."""

from __future__ import annotations

from typing import Any

import pytest


def count_served(mp: pytest.MonkeyPatch, native: Any) -> list[bool]:
    """Whether each call of the native path served its step (True) or left it to the graphs, from now
    until `mp` is undone."""
    served: list[bool] = []
    original_call = type(native).__call__

    def counting(self: Any, *args: Any) -> Any:
        out = original_call(self, *args)
        served.append(out is not None)
        return out

    mp.setattr(type(native), "__call__", counting)
    return served
