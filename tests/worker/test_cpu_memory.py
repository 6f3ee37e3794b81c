"""Huge-page host memory for the KV cache and the weights: same values, same ties, one buffer."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.worker.cpu_memory import anonymous_zeros, pack_parameters


def test_anonymous_zeros_is_a_writable_zero_tensor() -> None:
    t = anonymous_zeros((2, 3, 4, 16, 8), torch.bfloat16)
    assert t.shape == (2, 3, 4, 16, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1, 2] = 1.5
    assert t.sum().item() == 1.5 * 4 * 16 * 8
    assert anonymous_zeros((0, 4), torch.float32).shape == (0, 4)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.proj = nn.Linear(12, 12).to(torch.bfloat16)  # a second dtype in the same buffer
        self.head = nn.Linear(12, 37, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.proj(h.bfloat16()).float())


def test_pack_parameters_keeps_values_ties_and_gives_one_aligned_buffer() -> None:
    torch.manual_seed(0)
    model = _Tied()
    ids = torch.tensor([1, 5, 36])
    before = model(ids)
    pack_parameters(model)
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
    assert model.head.weight is model.embed.weight
    params = list(model.parameters())
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1, "every parameter lives in the one packed buffer"
    assert all(p.data_ptr() % 64 == 0 for p in params)
    # Packed views do not overlap.
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    # Still parameters that load_state_dict and in-place updates reach.
    model.embed.weight.data.zero_()
    assert not model.head.weight.any()
