"""Which way a step's forward runs, chosen here per step class and named:

* `native-c`: the model's native C body (`SupportsNativeDecode`, e.g. `models/native/llama_decode.py`)
  for steps of at most its `max_rows` tokens, at O1 and up; at O0 only a body that runs every step
  (`invariant_body`: bfloat16 batch invariance, which O0 keeps, as that body compiles nothing). It
  declines a step it cannot run (a prompt row, an active LoRA adapter, no attention metadata), which
  then takes the next way.
* `compiled`: the decoder blocks' graphs of the step's shape class (`CompiledForward`), at O1 and up.
* `eager`: the module itself (O0, `PAGEDLLM_BATCH_INVARIANT`, pooling models, pipeline stages).

The first step of each (path, step class) is logged at debug level (`decode path: native-c for steps
of 1..8 tokens`), and every step is counted by path: `pagedllm bench latency` reports the counts.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.models.interfaces import NativeDecoder, SupportsNativeDecode

logger = logging.getLogger("pagedllm.worker")

Forward = Callable[[torch.Tensor, torch.Tensor], object]


class DecodePath(enum.Enum):
    NATIVE_C = "native-c"
    COMPILED = "compiled"
    EAGER = "eager"


def invariant_body(model: nn.Module) -> NativeDecoder | None:
    """The model's native body where it runs every step (a bfloat16 model's batch-invariant body), for
    a forward that compiles nothing (O0, `enforce_eager`); None where it has none or runs decode rows
    only (that shortcut pairs with the compiled graphs: at O0 the module runs those steps).

    Without it an O0 step ran the module, whose products' rounding depends on the step's row count: a
    request's prompt tail after a prefix-cache hit, or a chunk of it, rounded differently from the same
    tokens in a whole prompt, and a greedy request could change its answer when asked again."""
    native = model.native_decoder() if isinstance(model, SupportsNativeDecode) else None
    return native if native is not None and native.runs_every_step(bound=False) else None


class ForwardPaths:
    """`(input_ids, positions) -> the forward's output` by the way the step's class takes: the native
    body where there is one (`native()`, read each step: sleep mode and tests drop it) and it serves
    the step, else `forward` (the compiled graphs when `describe` names their shape classes, else the
    eager module)."""

    def __init__(
        self,
        forward: Forward,
        native: Callable[[], NativeDecoder | None],
        describe: Callable[[int], str] | None,
    ) -> None:
        self.forward = forward
        self.native = native
        self.fallback = DecodePath.COMPILED if describe is not None else DecodePath.EAGER
        self._describe = describe
        # Steps run by each path since start (warm-up and profiling runs included).
        self.steps: Counter[str] = Counter()
        # The (path, token count) pairs already seen, and the (path, step class) pairs logged.
        self._seen: set[tuple[DecodePath, int]] = set()
        self._logged: set[tuple[DecodePath, str]] = set()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> object:
        n = input_ids.shape[0]
        native = self.native()
        if native is not None and n <= native.max_rows:
            hidden = native(input_ids, positions)
            if hidden is not None:
                self._ran(DecodePath.NATIVE_C, n, native.max_rows)
                return hidden
        out = self.forward(input_ids, positions)
        self._ran(self.fallback, n, 0)
        return out

    def _ran(self, path: DecodePath, num_tokens: int, max_rows: int) -> None:
        self.steps[path.value] += 1
        if (path, num_tokens) in self._seen:
            return
        self._seen.add((path, num_tokens))
        if path is DecodePath.NATIVE_C:
            # (A native body that runs every step, bf16 batch invariance, has no row bound.)
            step_class = f"1..{max_rows} tokens" if max_rows < 1 << 31 else "any size"
        else:
            step_class = "any size" if self._describe is None else self._describe(num_tokens)
        if (path, step_class) not in self._logged:
            self._logged.add((path, step_class))
            logger.debug("decode path: %s for steps of %s", path.value, step_class)
