"""The RL trainer side of the weight transfer tests, run in a spawned process: kept apart from the test
module so that the child imports only torch, safetensors and the transfer protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pagedllm.distributed.ipc_transfer import trainer_ipc_update_info
from pagedllm.distributed.weight_transfer import WeightUpdateRefused, trainer_init, trainer_send_weights

# Small buckets, so that a push takes several broadcasts.
BUCKET_BYTES = 64 * 1024


def checkpoint(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def bad_updates(tensors: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """A wrong shape for the fused q_proj shards, and an unknown name after good tensors."""
    wrong_shape = [(n, t[:-1] if n.endswith("q_proj.weight") else t) for n, t in tensors]
    wrong_name = [*tensors[:3], ("model.layers.0.self_attn.no_such.weight", tensors[0][1])]
    return [wrong_shape, wrong_name]


def run_trainer(init_info: dict[str, Any], model_dir: str, results: Any) -> None:
    """Join the group, push a good update, then the two bad ones; report each outcome on `results`."""
    group = trainer_init(init_info)
    tensors = checkpoint(Path(model_dir))
    trainer_send_weights(group, tensors, BUCKET_BYTES)
    results.put("sent")
    for bad in bad_updates(tensors):
        try:
            trainer_send_weights(group, bad, BUCKET_BYTES)
            results.put("sent")
        except WeightUpdateRefused:
            results.put("refused")


def run_ipc_trainer(model_dir: str, infos: Any, done: Any) -> None:
    """Share a good update and the two bad ones by handle (update_info for each on `infos`), keeping
    the tensors alive until the test says `done`."""
    tensors = checkpoint(Path(model_dir))
    updates = [tensors, *bad_updates(tensors)]
    for named in updates:
        infos.put(trainer_ipc_update_info(named))
    done.get(timeout=300)


def share_cuda_tensors(infos: Any, done: Any) -> None:
    """Share CUDA tensors by IPC handle (a whole tensor, a strided view, a bfloat16 one), putting their
    values and the update_info on `infos`; keep them alive until the test says `done`."""
    base = torch.arange(48, dtype=torch.float32, device="cuda").reshape(6, 8)
    named = [
        ("whole", base),
        ("view", base[1:5, ::2]),
        ("bf16", torch.linspace(-1, 1, 10, device="cuda").to(torch.bfloat16)),
    ]
    infos.put(([(name, t.cpu()) for name, t in named], trainer_ipc_update_info(named)))
    done.get(timeout=120)
