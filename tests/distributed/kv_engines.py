"""Offline engines on a tiny random Llama for the KV connector tests, with the scheduler's work counted."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import Scheduler

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@dataclass
class Counted:
    """Sums over the engine's steps: tokens scheduled, and what the scheduler reported."""

    scheduled_tokens: int = 0
    external_hits: int = 0
    stats: dict[str, float] = field(default_factory=dict)


def make_llm(model_dir: Path, **kwargs: Any) -> tuple[LLM, Counted]:
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        **kwargs,
    )
    scheduler: Scheduler = llm.llm_engine.engine_core.core.scheduler
    counted = Counted()
    schedule, make_stats = scheduler.schedule, scheduler.make_stats

    def counting_schedule() -> Any:
        out = schedule()
        counted.scheduled_tokens += out.total_num_scheduled_tokens
        return out

    def counting_stats() -> Any:
        stats = make_stats()
        if stats is not None:
            counted.external_hits += stats.external_prefix_cache_hits
            for key, value in stats.kv_connector_stats.items():
                counted.stats[key] = counted.stats.get(key, 0.0) + value
        return stats

    scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    scheduler.make_stats = counting_stats  # type: ignore[method-assign]
    return llm, counted


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(length)] for _ in range(n)]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """One request at a time (so each one's blocks are freed, and maybe evicted, before the next)."""
    return [
        list(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        for p in prompts
    ]
