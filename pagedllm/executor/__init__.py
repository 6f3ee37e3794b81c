"""Executors: how the engine core runs its workers (one in-process worker for now)."""

from pagedllm.executor.abstract import Executor

__all__ = ["Executor"]
