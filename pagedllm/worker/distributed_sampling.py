"""Sampling with several ranks: one rank samples, every rank learns the tokens.

Every rank keeps the sequences of its requests (its input batch appends each sampled token), but only
the output rank (`parallel_state.output_rank`: the first rank of the last pipeline stage, which holds
the whole logits) runs the sampler, so seeded and unseeded sampling, grammars and logprobs happen
once; the token ids (one int64 per request) are then broadcast over the world's host group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from pagedllm.distributed import parallel_state

T = TypeVar("T")


def sample_on_output_rank(
    sample: Callable[[], tuple[list[int], list[T | None]]], num_tokens: int, broadcast: bool = True
) -> tuple[list[int], list[T | None]] | None:
    """`sample()` on the output rank; elsewhere its token ids (and no logprobs), or None without
    `broadcast`: with several batches in flight (pipeline parallelism) the stages run different
    batches at once, so no step may wait on all of them; the other ranks then learn the tokens from
    the scheduler output of the request's next step (`CachedRequestData.token_ids`)."""
    world = parallel_state.get_world_group()
    if world.world_size == 1:
        return sample()
    src = parallel_state.output_rank(
        parallel_state.get_tp_group().world_size, parallel_state.get_pp_group().world_size
    )
    if world.rank == src:
        sampled, logprobs = sample()
        if not broadcast:
            return sampled, logprobs
        ids = torch.tensor(sampled, dtype=torch.int64)
    elif not broadcast:
        return None
    else:
        logprobs = [None] * num_tokens
        ids = torch.empty(num_tokens, dtype=torch.int64)
    world.broadcast(ids, src=src)
    return ids.tolist(), logprobs
