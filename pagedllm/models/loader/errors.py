"""The one exception type model loading raises, so callers (CLI, server) can print its message
instead of a traceback."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model cannot be loaded: missing or corrupt files, unsupported architecture or format."""
