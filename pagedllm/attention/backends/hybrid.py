"""The composite: which backend runs each step class of a layer, chosen once per layer and named.

Each step class has an order of preference; the first backend that serves the layer's features
(`unsupported` is None) runs that class, and the ones passed over say why. A mixed step runs its
decode rows and its prompt segments each on its class's backend (as mini-sglang's hybrid backend
splits prefill and decode). No backend for a class is an `UnsupportedAttention` error naming every
candidate's reason, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from pagedllm.attention.backends.cpu_native import NATIVE
from pagedllm.attention.backends.dense_decode import COMPILED_DENSE
from pagedllm.attention.backends.portable import PORTABLE
from pagedllm.attention.backends.protocol import (
    DENSE_DECODE_MAX_REQS,
    AttentionFeatures,
    AttentionKernels,
    DecodeKernels,
    PromptKernels,
    StepClass,
    UnsupportedAttention,
)

K = TypeVar("K", bound=AttentionKernels)

DECODE_PREFERENCE: dict[StepClass, tuple[DecodeKernels, ...]] = {
    StepClass.FEW_DECODES: (NATIVE, COMPILED_DENSE, PORTABLE),
    StepClass.DECODES: (NATIVE, PORTABLE),
}
PROMPT_PREFERENCE: tuple[PromptKernels, ...] = (NATIVE, PORTABLE)


@dataclass(frozen=True)
class Choice:
    """The backend chosen for one step class, and why each one preferred over it was passed over."""

    step: StepClass
    name: str
    passed_over: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        reasons = "; ".join(f"not {name}: {why}" for name, why in self.passed_over)
        return f"{self.step.value}: {self.name}" + (f" ({reasons})" if reasons else "")


def choose(features: AttentionFeatures, step: StepClass, candidates: Sequence[K]) -> tuple[K, Choice]:
    """The first of `candidates` that serves `step` rows of a layer with `features`, and the named
    choice; `UnsupportedAttention` where none does."""
    passed_over: list[tuple[str, str]] = []
    for kernels in candidates:
        why = kernels.unsupported(features, step)
        if why is None:
            return kernels, Choice(step, kernels.name, tuple(passed_over))
        passed_over.append((kernels.name, why))
    reasons = "; ".join(f"{name}: {why}" for name, why in passed_over)
    raise UnsupportedAttention(f"no attention backend serves the {step.value} of this layer ({reasons})")


@dataclass(frozen=True)
class LayerKernels:
    """A layer's backend per step class. The backend of its many-row decodes also stores its keys
    and values in every step (the native kernels and tensor ops store the same layout)."""

    few_decodes: DecodeKernels
    decodes: DecodeKernels
    prompts: PromptKernels
    choices: tuple[Choice, ...]

    @classmethod
    def of(cls, features: AttentionFeatures) -> LayerKernels:
        few, few_choice = choose(features, StepClass.FEW_DECODES, DECODE_PREFERENCE[StepClass.FEW_DECODES])
        many, many_choice = choose(features, StepClass.DECODES, DECODE_PREFERENCE[StepClass.DECODES])
        prompts, prompt_choice = choose(features, StepClass.PROMPTS, PROMPT_PREFERENCE)
        return cls(few, many, prompts, (few_choice, many_choice, prompt_choice))

    @property
    def writer(self) -> DecodeKernels:
        return self.decodes

    def decode_for(self, num_rows: int) -> DecodeKernels:
        return self.few_decodes if num_rows <= DENSE_DECODE_MAX_REQS else self.decodes

    def names(self) -> dict[str, str]:
        """The backend of each step class, by the class's name."""
        return {c.step.value: c.name for c in self.choices}
