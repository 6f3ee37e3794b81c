"""Batch-invariant execution (``PAGEDLLM_BATCH_INVARIANT=1``): a request's hidden states, logits and
logprobs are bitwise the same whichever other requests share its steps.

What varies with the batch on CPU, measured: float32 matrix products. oneDNN/MKL computes the rows
of a product in blocks of 4 (and 8, 16 for larger M) and the leftover rows with other kernels, so a
row's result depends on the row count M and on its position in the batch (rows 0-3 of an M=3 product
differ from the same rows of M=4 in the last bits). bfloat16 products measured invariant, and
everything else of the forward is row-wise (norms, rotary, activations) or per request (attention).
The mode pads every 2-D linear input to a multiple of `ROW_MULTIPLE` rows, where each row's result
equals that of any other padded product (checked for M up to 300 at several shapes). The padding
costs up to 15 extra rows per product, and the runner runs the eager model under the mode (no
compiled graphs, no native decode path, whose kernels the mode cannot reach): slower, most of all for
one-sequence decode.

By default no such padding runs: seeded sampling draws from the request's own generator only, so a
seeded request samples the same tokens alone or in any batch except where last-bit differences of
its logits move a draw across a token boundary, rare in float32 and more frequent in bfloat16
models with flat distributions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Rows of a product are padded up to a multiple of this.
ROW_MULTIPLE = 16


class BatchInvariantMode(TorchFunctionMode):
    """Within this mode, `F.linear` on a 2-D input runs on rows padded with zeros to a multiple of
    `ROW_MULTIPLE` (the padding rows are dropped from the result)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and args and args[0].dim() == 2:
            x = args[0]
            rows = x.shape[0]
            padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
            if padded != rows:
                x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
                return func(x, *args[1:], **kwargs)[:rows]
        return func(*args, **kwargs)
