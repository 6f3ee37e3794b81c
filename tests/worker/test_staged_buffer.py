"""Step-input buffers: on CPU the device view is the host buffer itself (no copy per step)."""

from __future__ import annotations

import torch

from pagedllm.worker.staged_buffer import StagedBuffer


def test_cpu_buffer_is_written_in_place() -> None:
    buf = StagedBuffer(8, torch.int64, torch.device("cpu"), pin=False)
    buf.np[:3] = [5, 6, 7]
    view = buf.to_device(3)
    assert view.tolist() == [5, 6, 7]
    buf.np[0] = 9
    assert view[0].item() == 9  # same storage: nothing was copied
