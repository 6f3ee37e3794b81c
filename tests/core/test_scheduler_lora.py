"""The scheduler with LoRA adapters (no model): at most max_loras adapters per step, first come first
served across adapters (no starvation), prefix-cache blocks never shared between adapters."""

from __future__ import annotations

from fake_runner import FakeRunner, make_request, make_scheduler, run_until_done, step


def test_at_most_max_loras_per_step_and_no_starvation() -> None:
    s = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=128, max_loras=2)
    runner = FakeRunner(s.block_size)
    for i, lora in enumerate([1, 1, 2, 0, 3]):
        s.add_request(make_request(s, f"r{i}", [10 + i, 2, 3], max_tokens=6, lora_int_id=lora))
    admitted: list[str] = []
    late = 0
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        # Requests for the running adapter 1 keep arriving: they must not overtake adapter 3's request.
        s.add_request(make_request(s, f"late{late}", [7, late % 50], max_tokens=3, lora_int_id=1))
        late += 1
        so, _ = step(s, runner)
        loras = {s.requests[r].lora_int_id for r in so.num_scheduled_tokens if r in s.requests} - {0}
        loras |= {n.lora_request.lora_int_id for n in so.scheduled_new_reqs if n.lora_request}
        assert len(loras) <= 2
        admitted += [n.req_id for n in so.scheduled_new_reqs]
    # r4 (adapter 3) waited for a slot, and every request that arrived after it was admitted after it.
    assert admitted.index("r4") < min(
        admitted.index(r) for r in admitted if r.startswith("late") and r != "late0"
    )
    assert "r3" in admitted[:4]  # the base-model request needs no slot
    run_until_done(s, runner)


def test_prefix_blocks_are_keyed_by_adapter() -> None:
    s = make_scheduler(max_loras=4)
    runner = FakeRunner(s.block_size)
    prompt = list(range(1, 14))
    s.add_request(make_request(s, "base", prompt, max_tokens=1))
    run_until_done(s, runner)
    for name, lora in (("a1", 1), ("a1-again", 1), ("a2", 2), ("base-again", 0)):
        req = make_request(s, name, prompt, max_tokens=1, lora_int_id=lora)
        s.add_request(req)
        step(s, runner)
        run_until_done(s, runner)
        # Hits only on blocks the same adapter (or the base model) computed: 12 of 13 tokens.
        assert req.num_cached_tokens == (12 if name.endswith("again") else 0), name
