"""The draft lengths (pagedllm.spec_decode.draft_control): the per-batch-size schedule and off-switch,
and the per-request rule on scripted token histories: the cost model's choice, determinism, the
back-off on rejected (chat-like) drafts and the resumption through shadow drafts once the output
copies."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_control import (
    DECAY,
    VERIFY_BASE,
    VERIFY_PER_DRAFT,
    DraftControl,
    DraftLength,
    best_length,
    expected_gain,
)


def test_best_length_against_brute_force() -> None:
    assert expected_gain(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    for a in np.linspace(0.0, 1.0, 21):
        for k in range(0, 9):
            nets = [0.0] + [expected_gain(a, n) - VERIFY_BASE - VERIFY_PER_DRAFT * n for n in range(1, k + 1)]
            assert best_length(a, k) == int(np.argmax(nets)), (a, k)
    # Everything accepted: all k; nothing accepted: none.
    assert best_length(1.0, 6) == 6
    assert best_length(0.0, 6) == 0


def _drive(control: DraftControl, copied_from: int, k: int = 4, length: int = 60) -> list[int]:
    """Decode one request whose target output is 1000, 1001, ...: before output position
    ``copied_from`` the drafter proposes wrong tokens (open-ended text), from there on the target's
    next tokens (copied text). Returns the draft length verified at every step."""
    prompt = list(range(100, 120))
    out: list[int] = []
    lengths = []
    while len(out) < length:
        seq = np.asarray(prompt + out, dtype=np.int64)
        pos = len(out)
        proposal = [1000 + pos + j for j in range(k)] if pos >= copied_from else [1, 2, 3, 4][:k]
        n = control.length("r", seq, k)
        lengths.append(n)
        if n > 0 or control.wants_shadow("r"):
            control.record("r", proposal[:n] if n else proposal, seq.size)
        accepted = 0
        while accepted < n and proposal[accepted] == 1000 + pos + accepted:
            accepted += 1
        out += [1000 + pos + j for j in range(accepted + 1)]
    return lengths


def test_backs_off_on_rejections_and_resumes_on_copying() -> None:
    control = DraftControl(shadows=True)
    lengths = _drive(control, copied_from=20)
    # A new request drafts all k at once; rejections stop drafting within a few steps, and it stays off.
    assert lengths[0] == 4
    first_off = lengths.index(0)
    assert first_off <= 3
    assert all(n == 0 for n in lengths[first_off:20])
    # Once the output follows the (shadow) drafts, drafting resumes within a few steps and drafts all k.
    assert lengths[20:30].count(4) >= 3
    assert lengths[-1] == 4


def test_no_shadows_for_model_drafters() -> None:
    control = DraftControl(shadows=False)
    lengths = _drive(control, copied_from=20)
    # At least one draft every step, fewer after rejections, more once drafts are accepted again.
    assert min(lengths) == 1 and lengths[0] == 4
    assert lengths[19] == 1 and lengths[-1] > 1
    assert not control.wants_shadow("r")


def test_same_history_same_lengths() -> None:
    assert _drive(DraftControl(shadows=True), 20) == _drive(DraftControl(shadows=True), 20)


def test_pending_drafts_scored_once_decided() -> None:
    control = DraftControl(shadows=True)
    tokens = np.asarray([1, 2, 3], dtype=np.int64)
    control.length("r", tokens, 4)
    control.record("r", [4, 5, 6], 3)
    before = control.requests["r"].acceptance
    # Two of three drafts matched so far: not decided yet, nothing scored.
    control.length("r", np.asarray([1, 2, 3, 4, 5], dtype=np.int64), 4)
    assert control.requests["r"].pending == [4, 5, 6]
    assert control.requests["r"].acceptance == before
    # The third differs: 2 accepted of 3 tries.
    control.length("r", np.asarray([1, 2, 3, 4, 5, 9], dtype=np.int64), 4)
    h = control.requests["r"]
    assert h.pending is None
    assert (h.accepted, h.tried) == (DECAY + 2, DECAY + 3)
    control.forget("r")
    assert "r" not in control.requests


def test_draft_length_schedule_and_off_switch() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, num_speculative_tokens_per_batch_size={2: 4, 8: 2})
    length = DraftLength(spec, max_num_reqs=8, max_step_tokens=20)
    assert [length(n) for n in (1, 2, 3, 4, 8)] == [4, 4, 2, 2, 1]
    plain = DraftLength(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 64, max_step_tokens=20)
    # Shrinks to fit 20 target tokens, and stops at 10 requests (1 + 1 draft each fills the step).
    assert [plain(n) for n in (1, 4, 5, 9, 10, 11, 64)] == [4, 4, 3, 1, 1, 0, 0]
