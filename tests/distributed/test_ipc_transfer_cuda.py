"""IPC weight updates on CUDA: a trainer process shares CUDA tensors as typed handles (plain JSON), and
this process maps them with the values the trainer holds, views included (skipped without CUDA)."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
from trainer_proc import share_cuda_tensors

from pagedllm.distributed.ipc_transfer import open_ipc_tensors
from pagedllm.distributed.weight_transfer import specs_from_update_info

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_tensors_shared_by_typed_handles() -> None:
    ctx = multiprocessing.get_context("spawn")
    infos, done = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=share_cuda_tensors, args=(infos, done))
    trainer.start()
    try:
        expected, info = infos.get(timeout=120)
        info = json.loads(json.dumps(info))  # what a client would POST
        device = torch.device("cuda", torch.cuda.current_device())
        got = open_ipc_tensors(info, specs_from_update_info(info), device)
        assert [name for name, _ in got] == [name for name, _ in expected]
        for (_, tensor), (_, want) in zip(got, expected):
            assert tensor.device == device and torch.equal(tensor.cpu(), want)
        del got
        torch.cuda.synchronize()
        done.put("done")
        trainer.join(60)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()
