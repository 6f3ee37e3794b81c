"""Per-request draft lengths from each request's recent acceptance, and the cheap drafters' back-off.

Each request keeps ``a``, an exponential moving average (weight 1/2) of the fraction of its drafted
tokens that were accepted, starting at 1. It drafts ``max(1, round(k * a))`` of the ``k`` tokens the
batch allows: copied text (everything accepted) drafts the full k again within a step or two, text
where drafts keep failing verifies one extra row instead of k.

The back-off (n-gram and suffix drafting only): drafting n tokens is expected to add
``a + a^2 + ... + a^n`` tokens to a step, and verifying them costs about ``VERIFY_OVERHEAD`` of a
plain decode step (the target's forward of 1 + n rows against 1 row; `VerifyCost` measures it as the
engine runs, since it differs by machine, load, threads and dtype). When the expected gain is below
that overhead the request drafts nothing for ``FIRST_PAUSE`` steps, then probes: it drafts again, and
the verification's result decides. If the gain (with the probe's acceptance folded into ``a``) clears
the overhead the probe succeeded: the request drafts on, and its next pause is FIRST_PAUSE again.
Otherwise the probe failed: the request pauses again, for twice as long as the last pause, up to
``MAX_PAUSE`` steps. A step where the drafter finds nothing to propose (no n-gram match) drafts and
verifies nothing and changes nothing here. On open-ended text this turns most steps back into plain
one-row decode steps (at most one probe every MAX_PAUSE steps) while a request that starts copying
is caught within MAX_PAUSE steps.

Model drafters (draft_model, EAGLE) keep the draft-length rule but not the pause: their drafts cost
the drafter's own forwards as well, which this overhead does not price, and an EAGLE head must read the
target's hidden states every step whether it drafts or not.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a decode step that verifies drafts costs more than one that does not, as a fraction of the latter,
# until `VerifyCost` has measured both. 0.2-0.5 on the quiet 2-core AVX2 EPYC (SmolLM2-135M float32,
# compiled default: 5-7 rows cost 1.2-1.5x a plain step); 1.8 there under a load average of 6 with one
# thread (`benchmarks/verify_overhead.py`: the plain steps take the native one-row path, verification
# the compiled one), and ~4 in bf16 without AMX: hence the measurement.
VERIFY_OVERHEAD = 0.3
# Weight of the newest step in the moving averages of the step times, and the most a step counts for
# (as a multiple of the average so far: a step that compiled a new shape is not the cost of the next).
COST_WEIGHT = 0.1
COST_CLIP = 2.0
FIRST_PAUSE = 4
MAX_PAUSE = 32
# Weight of the newest verification in the moving average of the acceptance.
ACCEPTANCE_WEIGHT = 0.5


class VerifyCost:
    """The verification overhead as this engine measures it: moving averages of the seconds of pure
    decode steps (no prefill) that verified drafts and of those that did not, at each batch size. The
    overhead at a batch size is verified / plain - 1 once both are known, else ``prior``."""

    def __init__(self, prior: float = VERIFY_OVERHEAD) -> None:
        self.prior = prior
        self.plain: dict[int, float] = {}
        self.verify: dict[int, float] = {}

    def observe(self, num_reqs: int, verified: bool, seconds: float) -> None:
        averages = self.verify if verified else self.plain
        old = averages.get(num_reqs)
        averages[num_reqs] = seconds if old is None else old + COST_WEIGHT * (min(seconds, COST_CLIP * old) - old)

    def overhead(self, num_reqs: int) -> float:
        plain, verify = self.plain.get(num_reqs), self.verify.get(num_reqs)
        if plain is None or verify is None:
            return self.prior
        return max(0.0, verify / plain - 1.0)


def expected_gain(acceptance: float, num_drafts: int) -> float:
    """Expected accepted tokens of ``num_drafts`` drafts each accepted with probability ``acceptance``
    (given the ones before it were): a + a^2 + ... + a^n."""
    return sum(acceptance**i for i in range(1, num_drafts + 1))


@dataclass
class _RequestState:
    acceptance: float = 1.0
    # Steps left to draft nothing.
    wait: int = 0
    # The length of the next pause.
    pause: int = FIRST_PAUSE
    # Paused, or probing: the next verification decides whether the request drafts on.
    probing: bool = False
    # The k the batch allowed at the request's last draft.
    k: int = 0

    def length(self) -> int:
        """Tokens to draft: max(1, round(k * a))."""
        return max(1, round(self.k * self.acceptance))


class DraftBackoff:
    """The per-request draft length (``num_drafts``, asked once per step for each request that may
    draft) and its update from each verification (``observe``). ``pausing`` turns the back-off on;
    ``overhead`` is the current verification overhead (the runner sets it from `VerifyCost`)."""

    def __init__(self, pausing: bool, overhead: float = VERIFY_OVERHEAD) -> None:
        self.pausing = pausing
        self.overhead = overhead
        self.requests: dict[str, _RequestState] = {}

    def num_drafts(self, req_id: str, k: int) -> int:
        """Tokens the request drafts this step, of the ``k`` the batch allows (0: none this step)."""
        if k <= 0:
            return 0
        s = self.requests.setdefault(req_id, _RequestState())
        s.k = k
        n = s.length()
        if not self.pausing:
            return n
        if s.wait > 0:
            s.wait -= 1
            return 0
        if not s.probing and expected_gain(s.acceptance, n) < self.overhead:
            # This step is the first of the pause.
            s.wait = s.pause - 1
            s.probing = True
            return 0
        return n

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of ``num_drafts`` drafts accepted the first ``num_accepted``."""
        if num_drafts <= 0:
            return
        s = self.requests.setdefault(req_id, _RequestState())
        rate = num_accepted / num_drafts
        s.acceptance = (1 - ACCEPTANCE_WEIGHT) * s.acceptance + ACCEPTANCE_WEIGHT * rate
        if s.probing and self.pausing:
            s.probing = False
            if expected_gain(s.acceptance, s.length()) >= self.overhead:
                s.pause = FIRST_PAUSE
            else:
                # num_drafts starts the doubled pause at the request's next step.
                s.pause = min(2 * s.pause, MAX_PAUSE)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
