"""The placeholder for a module another pipeline stage holds."""

from __future__ import annotations

from typing import Any

from torch import nn


class PPMissingLayer(nn.Module):
    """No parameters; keeps the layer indices (and so the weight names) of the stage's own modules.
    Calling it is a bug: a stage runs only its own layers."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module belongs to another pipeline stage")
