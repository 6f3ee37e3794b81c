"""The offloading tier's scheduler side with the fake runner (no model): a fake worker applies the
connector's copies to the fake KV cache, whose every read the runner checks, so a block loaded from the
wrong slot, or saved after it was overwritten, fails the run."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from fake_runner import FakeRunner, make_request, make_scheduler, step

from pagedllm.core.kv_events import MEDIUM_DISK, BlockRemoved, BlockStored, external_block_hash
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.kv_transfer.base import KVConnectorRole
from pagedllm.distributed.kv_transfer.offloading import OffloadingConnector
from pagedllm.kv_cache_interface import KVCacheSpec


def _scheduler(
    num_blocks: int, tier_blocks: int, kv_events: bool = False
) -> tuple[Scheduler, OffloadingConnector]:
    spec = KVCacheSpec(block_size=4, num_kv_heads=[1], head_size=[1], dtype=torch.float32)
    tier = OffloadingConnector(
        SimpleNamespace(kv_transfer_config=None),
        KVConnectorRole.SCHEDULER,
        spec,
        {"cpu_bytes_to_use": tier_blocks * spec.bytes_per_block},
    )
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=4, max_model_len=64, enable_kv_cache_events=kv_events
    )
    scheduler.kv_connector = tier
    tier.bind_scheduler(scheduler.requests, scheduler.kv_cache_manager)
    return scheduler, tier


class FakeTier:
    """The worker side: slot -> the tokens a block held when it was saved."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.slots: dict[int, list[int | None]] = {}

    def apply(self, meta) -> None:  # noqa: ANN001
        bs, cache = self.runner.block_size, self.runner.cache
        for block, slot in zip(meta.save_block_ids, meta.save_slots):
            self.slots[slot] = [cache.get((block, o)) for o in range(bs)]
        for block, slot in zip(meta.load_block_ids, meta.load_slots):
            for o, token in enumerate(self.slots[slot]):
                assert token is not None
                cache[(block, o)] = token


def _run(scheduler: Scheduler, runner: FakeRunner, tier: FakeTier) -> tuple[int, int]:
    """Steps until idle, the tier's copies applied between schedule and execute; returns (scheduled
    tokens, tokens loaded from the tier)."""
    schedule = scheduler.schedule

    def schedule_and_apply():  # noqa: ANN202
        so = schedule()
        tier.apply(so.kv_connector_metadata)
        return so

    scheduler.schedule = schedule_and_apply  # type: ignore[method-assign]
    scheduled = loaded = 0
    try:
        while scheduler.has_unfinished_requests():
            so, outs = step(scheduler, runner)
            scheduled += so.total_num_scheduled_tokens
            assert outs.scheduler_stats is not None
            loaded += outs.scheduler_stats.external_prefix_cache_hits
    finally:
        scheduler.schedule = schedule  # type: ignore[method-assign]
    return scheduled, loaded


def test_evicted_prefixes_come_back_from_the_tier() -> None:
    scheduler, connector = _scheduler(num_blocks=16, tier_blocks=64)
    runner = FakeRunner(4)
    tier = FakeTier(runner)
    prompts = [[100 * i + t for t in range(22)] for i in range(4)]  # 5 full blocks each
    for i, p in enumerate(prompts):
        scheduler.add_request(make_request(scheduler, f"a{i}", p, max_tokens=2))
        _run(scheduler, runner, tier)
    # Each prompt's blocks were evicted by the next ones; the tier holds them now.
    for i, p in enumerate(prompts[:2]):
        scheduler.add_request(make_request(scheduler, f"b{i}", p, max_tokens=2))
        scheduled, loaded = _run(scheduler, runner, tier)
        assert loaded == 20 and scheduled == 22 - 20 + 1
        assert runner.result.tokens[f"b{i}"] == runner.result.tokens[f"a{i}"]
    assert len(connector._slots) > 0


def test_small_tier_under_random_traffic_never_serves_wrong_blocks() -> None:
    rng = random.Random(0)
    scheduler, _ = _scheduler(num_blocks=20, tier_blocks=5)
    runner = FakeRunner(4)
    tier = FakeTier(runner)
    stems = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
    total_loaded = 0
    for n in range(40):
        prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        for k in range(rng.randrange(1, 4)):  # several at once: evictions and loads in one step
            scheduler.add_request(make_request(scheduler, f"r{n}-{k}", prompt, max_tokens=3))
        # (The fake runner asserts every sampled position reads the request's own tokens.)
        total_loaded += _run(scheduler, runner, tier)[1]
    assert total_loaded > 0


def test_tier_blocks_appear_in_kv_events_with_their_medium() -> None:
    """A subscriber following the DISK-medium events knows exactly which hashes the tier holds."""
    rng = random.Random(1)
    scheduler, connector = _scheduler(num_blocks=16, tier_blocks=6, kv_events=True)
    runner = FakeRunner(4)
    tier = FakeTier(runner)
    held: set[int] = set()
    for n in range(12):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(8, 24))]
        scheduler.add_request(make_request(scheduler, f"r{n}", prompt, max_tokens=2))
        _run(scheduler, runner, tier)
        for event in scheduler.take_kv_events():
            if getattr(event, "medium", None) != MEDIUM_DISK:
                continue
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
        assert held == {external_block_hash(h) for h in connector._slots}
    assert held
