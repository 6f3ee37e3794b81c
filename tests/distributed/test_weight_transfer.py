"""Weight transfer from a trainer in another process (multiprocessing spawn) into a running engine,
over gloo (backend 'nccl' on the CPU) or by shared-memory handles (backend 'ipc'): after the push the
engine's greedy tokens are those of the pushed model under HF transformers; an update with a wrong
name or shape is refused whole (nothing is applied; over gloo the trainer is told)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile_payloads import pickled_ipc_handles
from tiny_llm import hf_greedy
from trainer_proc import BUCKET_BYTES, bad_updates, checkpoint, run_ipc_trainer, run_trainer

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.ipc_transfer import IPC_HANDLES_KEY, CudaStorage, trainer_ipc_update_info
from pagedllm.distributed.weight_transfer import (
    TensorSpec,
    buckets,
    specs_from_update_info,
    update_info_for,
)

PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 60]]
MAX_TOKENS = 10
SPAWN = multiprocessing.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, **kwargs)


@contextlib.contextmanager
def _trainer(target: Callable[..., None], *args: Any) -> Iterator[None]:
    """`target(*args)` in a spawned process, which must have exited cleanly when the block ends."""
    trainer = SPAWN.Process(target=target, args=args)
    trainer.start()
    try:
        yield
        # Polled, not join(): join waits on a pipe that the trainer's torch_shm_manager (file_system
        # sharing, the ipc test) inherits and keeps open for a minute after the trainer exited.
        deadline = time.monotonic() + 60
        while trainer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]  # type: ignore[arg-type]


def test_trainer_pushes_weights_into_a_running_engine(two_tiny_llms: tuple[Path, Path]) -> None:
    engine_dir, trainer_dir = two_tiny_llms
    llm = _llm(
        engine_dir,
        weight_transfer_config={"backend": "nccl", "extra": {"packed_buffer_size_bytes": BUCKET_BYTES}},
    )
    assert _greedy(llm) == hf_greedy(engine_dir, PROMPTS, MAX_TOKENS)
    expected = hf_greedy(trainer_dir, PROMPTS, MAX_TOKENS)
    assert expected != hf_greedy(engine_dir, PROMPTS, MAX_TOKENS)

    results = SPAWN.Queue()
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": _free_port(),
        "world_size": 2,
        "timeout_s": 120,
    }
    with _trainer(run_trainer, init_info, str(trainer_dir), results):
        llm.init_weight_transfer_engine({**init_info, "rank_offset": 1})
        tensors = checkpoint(trainer_dir)
        assert llm.update_weights(update_info_for(tensors)) == len(tensors)
        assert results.get(timeout=120) == "sent"
        assert _greedy(llm) == expected

        for bad, error in zip(bad_updates(tensors), ("does not match", "no matching parameter")):
            with pytest.raises(ValueError, match=f"refused, nothing was loaded: .*{error}"):
                llm.update_weights(update_info_for(bad))
            assert results.get(timeout=120) == "refused"
            # The good tensors listed before the bad one were not applied either.
            assert _greedy(llm) == expected


def test_trainer_shares_weights_by_ipc(two_tiny_llms: tuple[Path, Path]) -> None:
    """backend='ipc': a trainer process shares its tensors by handle (shared memory on the CPU); the
    engine maps them and loads them, refusing a bad update whole as the nccl path does."""
    engine_dir, trainer_dir = two_tiny_llms
    llm = _llm(engine_dir, weight_transfer_config={"backend": "ipc"})
    before = _greedy(llm)
    expected = hf_greedy(trainer_dir, PROMPTS, MAX_TOKENS)
    assert expected != before
    llm.init_weight_transfer_engine({})  # nothing to join: accepted for the API's symmetry

    infos, done = SPAWN.Queue(), SPAWN.Queue()
    with _trainer(run_ipc_trainer, str(trainer_dir), infos, done):
        good, wrong_shape, wrong_name = (infos.get(timeout=120) for _ in range(3))
        # Handles only, as plain JSON: a few hundred bytes per tensor, not the weights.
        assert len(json.dumps(good[IPC_HANDLES_KEY])) < 400 * len(good["names"])
        for bad, error in ((wrong_shape, "does not match"), (wrong_name, "no matching parameter")):
            with pytest.raises(ValueError, match=f"refused, nothing was loaded: .*{error}"):
                llm.update_weights(bad)
            assert _greedy(llm) == before
        # Specs that pass the model's check, but handles to other tensors: refused before any load.
        mismatched = {**good, IPC_HANDLES_KEY: wrong_shape[IPC_HANDLES_KEY]}
        with pytest.raises(
            ValueError, match=r"is float32 \(63, 64\), but update_info announced float32 \(64, 64\)"
        ):
            llm.update_weights(mismatched)
        assert _greedy(llm) == before
        assert llm.update_weights(good) == len(good["names"])
        assert _greedy(llm) == expected
        done.put("done")


def test_ipc_update_info_needs_handles(two_tiny_llms: tuple[Path, Path]) -> None:
    llm = _llm(two_tiny_llms[0], weight_transfer_config={"backend": "ipc"})
    tensors = checkpoint(two_tiny_llms[1])
    info = trainer_ipc_update_info(tensors)
    with pytest.raises(ValueError, match="needs ipc_handles"):
        llm.update_weights({k: v for k, v in info.items() if k != IPC_HANDLES_KEY})
    # In one process too (the same shared-memory path).
    assert llm.update_weights(info) == len(tensors)


def test_update_without_transfer_config_or_group_is_refused(two_tiny_llms: tuple[Path, Path]) -> None:
    llm = _llm(two_tiny_llms[0])
    with pytest.raises(ValueError, match="need weight_transfer_config"):
        llm.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1})
    with pytest.raises(ValueError, match="init_weight_transfer_engine must be called"):
        llm.update_weights({"names": [], "dtype_names": [], "shapes": []})


def test_update_weights_from_disk(two_tiny_llms: tuple[Path, Path]) -> None:
    engine_dir, other_dir = two_tiny_llms
    llm = _llm(engine_dir)
    before = _greedy(llm)
    assert llm.update_weights_from_disk(str(other_dir)) == len(checkpoint(other_dir))
    assert _greedy(llm) == hf_greedy(other_dir, PROMPTS, MAX_TOKENS) != before
    with pytest.raises(ValueError, match="does not exist"):
        llm.update_weights_from_disk(str(other_dir / "missing"))


def test_buckets_and_update_info() -> None:
    specs = [
        TensorSpec("a", torch.float32, (4, 4)),
        TensorSpec("b", torch.bfloat16, (3,)),
        TensorSpec("c", torch.float32, (20,)),
    ]
    # 64 + 6 bytes fit in 70; c (80 bytes) is larger than a bucket and goes alone.
    assert buckets(specs, 70) == [[0, 1], [2]]
    assert buckets(specs, 1) == [[0], [1], [2]]
    info = update_info_for([("a", torch.zeros(2, 3, dtype=torch.bfloat16))])
    assert info == {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}
    assert specs_from_update_info(info) == [TensorSpec("a", torch.bfloat16, (2, 3))]
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        specs_from_update_info({"names": ["a"], "dtype_names": ["float7"], "shapes": [[1]]})
    with pytest.raises(ValueError, match="1 names, 0 dtype_names"):
        specs_from_update_info({"names": ["a"], "dtype_names": [], "shapes": []})


def test_pickled_ipc_handles_are_refused_unopened(two_tiny_llms: tuple[Path, Path], tmp_path: Path) -> None:
    """vLLM's `ipc_handles_pickled` would run a payload's `__reduce__`: refused, nothing unpickled."""
    llm = _llm(two_tiny_llms[0], weight_transfer_config={"backend": "ipc"})
    tensors = checkpoint(two_tiny_llms[1])[:1]
    marker = tmp_path / "pwned"
    info = {**update_info_for(tensors), "ipc_handles_pickled": pickled_ipc_handles(marker)}
    with pytest.raises(ValueError, match="ipc_handles_pickled is not accepted"):
        llm.update_weights(info)
    assert not marker.exists()


def test_ipc_handles_are_checked_before_they_are_mapped(two_tiny_llms: tuple[Path, Path]) -> None:
    """A handle names a torch shared-memory file of the announced size through a torch shm manager,
    holding the view it describes; anything else is refused naming the tensor, before any load."""
    llm = _llm(two_tiny_llms[0], weight_transfer_config={"backend": "ipc"})
    tensors = checkpoint(two_tiny_llms[1])[:1]
    name = tensors[0][0]
    good = trainer_ipc_update_info(tensors)

    def with_handle(**changes: Any) -> dict[str, Any]:
        handle = json.loads(json.dumps(good[IPC_HANDLES_KEY]))
        shared = handle[0]["cpu"]
        for key, value in changes.items():
            target = shared["storage"] if key in shared["storage"] else shared
            target[key] = value
        return {**good, IPC_HANDLES_KEY: handle}

    storage = good[IPC_HANDLES_KEY][0]["cpu"]["storage"]
    cases = [
        (with_handle(name="/psm_0123"), "does not name a torch shared-memory file"),
        (with_handle(name="/../../etc/passwd"), "does not name a torch shared-memory file"),
        (with_handle(manager="/etc/passwd"), "does not name a torch shm manager socket"),
        (with_handle(manager="/tmp/torch-shm-dir-x/../../etc/manager.sock"), "manager socket"),
        (with_handle(nbytes=storage["nbytes"] * 4), "smaller than its handle says"),
        (with_handle(offset=1), "does not fit its storage"),
        (with_handle(stride=[-1] * len(tensors[0][1].shape)), "negative offset or stride"),
        (with_handle(shape=[1]), f"{name}' is float32 \\(1,\\)"),
        (with_handle(extra_field=1), "malformed"),
        ({**good, IPC_HANDLES_KEY: [{"cpu": {"storage": {"type": "pickle"}}}]}, "malformed"),
    ]
    before = _greedy(llm)
    for info, error in cases:
        with pytest.raises(ValueError, match=error):
            llm.update_weights(info)
    assert _greedy(llm) == before
    assert llm.update_weights(good) == 1


def test_cuda_ipc_reference_counter_is_bounded() -> None:
    """torch decrements the int64 at `ref_counter_offset` of the named counter file when it lets a
    CUDA mapping go: a handle may only name torch's counter files, inside their bounds (checked before
    any CUDA call, so on any machine)."""
    good = {"handle": b"h" * 64, "nbytes": 64, "offset_bytes": 0, "ref_counter_handle": b"/torch_1_2_3",
            "ref_counter_offset": 5, "event_handle": None, "event_sync_required": False}  # fmt: skip
    for bad in (
        {"ref_counter_offset": 10_000},
        {"ref_counter_offset": -1},
        {"ref_counter_handle": b"/etc/x"},
    ):
        with pytest.raises(ValueError, match="bad reference counter"):
            CudaStorage(**{**good, **bad}).open("w", torch.device("cpu"))
    with pytest.raises(ValueError, match="is a CUDA handle; this engine runs on cpu"):
        CudaStorage(**good).open("w", torch.device("cpu"))
