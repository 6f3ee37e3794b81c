"""Payloads a hostile client would send, for the tests that check nothing runs them."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path
from typing import Any


class _WritesMarker:
    """Unpickling this runs `open(path, "w")`, creating the file: proof that the bytes were unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def pickled_marker(marker: Path) -> bytes:
    """A pickle that creates `marker` when loaded."""
    return pickle.dumps(_WritesMarker(marker))


def pickled_ipc_handles(marker: Path) -> str:
    """vLLM's `ipc_handles_pickled` shape (base64 of a pickled list of `{device: handle}`), whose
    unpickling creates `marker`."""
    return base64.b64encode(pickle.dumps([{"cpu": _WritesMarker(marker)}])).decode("ascii")
