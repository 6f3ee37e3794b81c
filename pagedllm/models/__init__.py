"""Model architectures and weight loading."""

from pagedllm.models.loader import ModelLoadError, get_model, load_model
from pagedllm.models.registry import resolve_model_cls, supported_architectures

__all__ = ["ModelLoadError", "get_model", "load_model", "resolve_model_cls", "supported_architectures"]
