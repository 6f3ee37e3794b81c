"""Random workloads with aborts, under cache pressure: no request lost or leaked, outputs unchanged."""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeRunner, assert_all_blocks_free, make_request, make_scheduler, next_token, step

from pagedllm.core.request import RequestStatus
from pagedllm.engine.protocol import FinishReason


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_aborts(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 16])
    max_model_len = 48
    s = make_scheduler(
        num_blocks=max_model_len // block_size + rng.randrange(0, 20),
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=rng.randrange(1, 8),
        max_num_batched_tokens=rng.choice([3, 8, 32, 64]),
        enable_prefix_caching=rng.random() < 0.7,
        policy=rng.choice(["fcfs", "priority"]),
        long_prefill_token_threshold=rng.choice([0, 0, 5]),
    )
    runner = FakeRunner(s.block_size)
    shared = [rng.randrange(30) for _ in range(20)]
    prompts: dict[str, list[int]] = {}
    limits: dict[str, int] = {}
    aborted: set[str] = set()
    for i in range(40):
        prompt = shared[: rng.randrange(0, 21)] + [rng.randrange(30) for _ in range(rng.randrange(1, 12))]
        prompt = prompt[: max_model_len - 1]
        prompts[str(i)] = prompt
        limits[str(i)] = rng.randrange(1, 20)
    pending = list(prompts)
    for t in range(5000):
        if not pending and not s.has_unfinished_requests():
            break
        for _ in range(rng.randrange(0, 3)):
            if pending:
                r = pending.pop(0)
                s.add_request(
                    make_request(
                        s, r, prompts[r], max_tokens=limits[r], arrival_time=t, priority=rng.randrange(3)
                    )
                )
        if s.requests and rng.random() < 0.1:
            victim = rng.choice(sorted(s.requests))
            aborted.add(victim)
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        if s.has_unfinished_requests():
            step(s, runner)
    else:
        pytest.fail("the workload did not drain")
    # The runner's last step must also learn about the final aborts.
    s.schedule()
    assert_all_blocks_free(s)
    res = runner.result
    for r, prompt in prompts.items():
        # max_tokens, or max_model_len first.
        want = expected_tokens(prompt, min(limits[r], max_model_len - len(prompt)))
        got = res.tokens.get(r, [])
        if r in aborted and r not in res.finish:
            assert got == want[: len(got)]
        else:
            assert got == want and res.finish[r] == FinishReason.LENGTH
