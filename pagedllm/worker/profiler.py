"""The torch profiler of one worker (`profiler_config.profiler = "torch"`), started and stopped on demand.

Each start..stop run writes one Chrome trace (also what TensorBoard's profiler plugin reads) into
`torch_profiler_dir`, named after the engine instance and the worker's rank so that the traces of
several engines, workers and runs sharing a directory never collide.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from pagedllm.platforms import current_platform

logger = logging.getLogger("pagedllm.worker")


class TorchProfiler:
    def __init__(self, trace_dir: str, instance_id: str, rank: int, dp_rank: int | None = None) -> None:
        """``dp_rank``: the engine core's data parallel rank, in the trace names when there are several."""
        self.trace_dir = Path(trace_dir).expanduser()
        dp = "" if dp_rank is None else f"-dp{dp_rank}"
        self.worker_name = f"pagedllm-{instance_id or 'engine'}{dp}-rank{rank}"
        self._profile: torch.profiler.profile | None = None

    def start(self) -> None:
        if self._profile is not None:
            raise ValueError("the profiler is already running (call stop_profile first)")
        activities = [ProfilerActivity.CPU]
        if current_platform.is_cuda():
            activities.append(ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()
        logger.info("torch profiler started; the trace goes to %s", self.trace_dir)

    def stop(self) -> str:
        """Stop and write the trace; returns its path."""
        if self._profile is None:
            raise ValueError("the profiler is not running (call start_profile first)")
        profile, self._profile = self._profile, None
        profile.stop()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"{self.worker_name}.{time.time_ns()}.pt.trace.json"
        profile.export_chrome_trace(str(path))
        logger.info("torch profiler trace written to %s", path)
        return str(path)
