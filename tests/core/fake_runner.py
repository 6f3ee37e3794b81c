"""A model-free stand-in for the model runner, and helpers to drive the scheduler with it.

`FakeRunner` keeps the runner's per-request state exactly as the real one does (tokens from
`NewRequestData`, its own sampled tokens, block tables grown by `CachedRequestData`) and simulates the KV
cache: every scheduled token is written to its (block, offset) slot, and a request samples from what
its block table reads back from the cache, not from its own token list. The sampled token is a
deterministic function of the whole sequence as read from the cache, so a bookkeeping error in the
scheduler or the KV cache manager (a wrong prefix hit, a block freed while in use, a missing block, a
lost token after preemption) changes the outputs or trips an assertion.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.hashing import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutputs, FinishReason
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

VOCAB = 1000


def next_token(seq: list[int]) -> int:
    """The fake model: a rolling hash of the whole sequence."""
    h = 17
    for t in seq:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return h % VOCAB


@dataclass
class RunResult:
    """What the scheduler reported, accumulated over every step of one FakeRunner."""

    tokens: dict[str, list[int]]
    finish: dict[str, FinishReason]
    stop_reason: dict[str, int | str | None]
    num_preemptions: int = 0
    steps: int = 0


@dataclass
class _RunnerReq:
    tokens: list[int]
    blocks: list[int]
    num_computed: int


@dataclass
class FakeRunner:
    block_size: int
    # req_id -> tokens to return instead of the fake model's, in order (then the model takes over).
    scripts: dict[str, list[int]] = field(default_factory=dict)
    reqs: dict[str, _RunnerReq] = field(default_factory=dict)
    # (block id, offset) -> token id written there.
    cache: dict[tuple[int, int], int] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    result: RunResult = field(default_factory=lambda: RunResult({}, {}, {}))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            assert req_id in self.reqs, f"preempted {req_id} was unknown to the runner"
            del self.reqs[req_id]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            assert new.num_computed_tokens % self.block_size == 0, "prefix hits are whole blocks"
            self.reqs[new.req_id] = _RunnerReq(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            st = self.reqs[req_id]
            assert st.num_computed == num_computed, (
                f"{req_id}: runner at {st.num_computed}, told {num_computed}"
            )
            st.blocks.extend(new_blocks)
        assert set(cached.req_ids).isdisjoint(r.req_id for r in so.scheduled_new_reqs)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert set(so.num_scheduled_tokens) == set(cached.req_ids) | {r.req_id for r in so.scheduled_new_reqs}

        # Every layer writes the whole step's KV before it attends: write all, then read.
        spans: dict[str, tuple[int, int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            start, end = st.num_computed, st.num_computed + n
            assert n > 0 and end <= len(st.tokens), f"{req_id}: scheduled past its tokens"
            assert len(st.blocks) * self.block_size >= end, f"{req_id}: too few blocks for {end} tokens"
            for pos in range(start, end):
                self.cache[(st.blocks[pos // self.block_size], pos % self.block_size)] = st.tokens[pos]
            spans[req_id] = (start, end)

        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            st = self.reqs[req_id]
            start, end = spans[req_id]
            st.num_computed = end
            if end < len(st.tokens):
                sampled.append([])  # mid-prefill chunk
                continue
            seq = [self.cache[(st.blocks[p // self.block_size], p % self.block_size)] for p in range(end)]
            assert seq == st.tokens, f"{req_id}: the KV cache does not hold the request's tokens"
            script = self.scripts.get(req_id)
            token = script.pop(0) if script else next_token(seq)
            st.tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    enable_prefix_caching: bool = True,
    log_stats: bool = True,
    enable_kv_cache_events: bool = False,
    max_loras: int | None = None,
    max_concurrent_batches: int = 1,
    **sched: Any,
) -> Scheduler:
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        **sched,
    )
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(
        sc,
        cc,
        num_blocks,
        max_model_len,
        log_stats=log_stats,
        enable_kv_cache_events=enable_kv_cache_events,
        max_loras=max_loras,
        max_concurrent_batches=max_concurrent_batches,
    )


def make_request(
    scheduler: Scheduler,
    req_id: str,
    prompt: list[int],
    max_tokens: int | None = 8,
    eos_token_id: int | None = None,
    arrival_time: float = 0.0,
    priority: int = 0,
    algo: str = "sha256",
    lora_int_id: int = 0,
    **params: Any,
) -> Request:
    cc = CacheConfig(
        block_size=scheduler.block_size,
        enable_prefix_caching=scheduler.kv_cache_manager.enable_caching,
        prefix_caching_hash_algo=algo,  # type: ignore[arg-type]
    )
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(
        req_id,
        prompt,
        sp,
        eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        block_hasher=get_request_block_hasher(cc),
        lora_request=LoRARequest(f"lora{lora_int_id}", lora_int_id, "/adapters") if lora_int_id else None,
    )


def check_step_limits(scheduler: Scheduler, so: SchedulerOutput) -> None:
    assert (
        so.total_num_scheduled_tokens
        <= scheduler.max_num_scheduled_tokens
        <= scheduler.max_num_batched_tokens
    )
    assert len(so.num_scheduled_tokens) <= scheduler.max_num_seqs
    assert len(scheduler.running) <= scheduler.max_num_seqs
    # Every running request has work (a decode or the rest of its prompt): one left out of a step means
    # the step's budget was used up, never lost.
    if any(r.request_id not in so.num_scheduled_tokens for r in scheduler.running):
        assert so.total_num_scheduled_tokens == scheduler.max_num_scheduled_tokens


def check_block_accounting(scheduler: Scheduler) -> None:
    """Every block's ref count equals the number of live block tables holding it, and only running
    requests hold blocks: a request's references drop back to zero the moment it finishes, is aborted
    or is preempted (not only once the whole run is over)."""
    kv = scheduler.kv_cache_manager
    assert set(kv.req_to_blocks) == {r.request_id for r in scheduler.running}
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    for blocks in kv.req_to_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a block twice in one table"
    pool = kv.block_pool
    assert [b.ref_cnt for b in pool.blocks] == [holders[b.block_id] for b in pool.blocks]
    assert pool.get_num_free_blocks() == sum(1 for b in pool.blocks if b.ref_cnt == 0)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One engine step; the outputs are also accumulated in `runner.result`."""
    so = scheduler.schedule()
    check_step_limits(scheduler, so)
    check_block_accounting(scheduler)
    outs = scheduler.update_from_output(so, runner.execute_model(so))
    check_block_accounting(scheduler)
    result = runner.result
    result.steps += 1
    if outs.scheduler_stats is not None:
        result.num_preemptions += outs.scheduler_stats.num_preemptions
    for o in outs.outputs:
        result.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finish_reason is not None:
            assert o.request_id not in result.finish, "finished twice"
            result.finish[o.request_id] = o.finish_reason
            result.stop_reason[o.request_id] = o.stop_reason
    return so, outs


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 2000) -> RunResult:
    """Step until every request finished, then check that the whole cache is free again. Returns
    everything reported since the runner was created (earlier `step` calls included)."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner)
    assert not scheduler.has_unfinished_requests(), "requests left after max_steps"
    assert_all_blocks_free(scheduler)
    return runner.result


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_blocks == len(pool.free_block_queue.get_all_free_blocks())
    assert kv.usage == 0.0
    assert scheduler.running == [] and len(scheduler.waiting) == 0
