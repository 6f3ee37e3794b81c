"""The packed 4-bit layouts of AWQ and GPTQ checkpoints, read into the kernels' layout (int4_kernels.c).

Both store W [out, in] as w = s * (q - z) per group of `group` input columns, 4-bit values packed eight
to an int32 (value j of a word at bits 4j..4j+3):
  AWQ (AutoAWQ, "gemm" version): qweight [in, out/8], qzeros [in/group, out/8], both packing eight
    output columns in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (word value j holds column
    ORDER[j]); scales [in/group, out] float16.
  GPTQ (AutoGPTQ / GPTQModel, checkpoint format "gptq", v1): qweight [in/8, out] packs eight input rows
    in order; qzeros [in/group, out/8] packs output columns in order and stores z - 1 (the zero is the
    stored value + 1); scales [in/group, out]; g_idx [in] the group of each input column. With
    act-order (desc_act) g_idx is a permutation of the plain i // group: the columns are then reordered
    at load so that groups are contiguous, and each activation row is gathered in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.layers.quant.int4 import Int4QuantizationConfig
    from pagedllm.quant_interface import CheckpointTensors

# The output column each of an AWQ word's eight values holds; `_AWQ_UNDO[c]` is the value of column c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = [AWQ_ORDER.index(c) for c in range(8)]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _values(packed: torch.Tensor) -> torch.Tensor:
    """[..., 8] uint8: the eight 4-bit values of each int32 word, value j last."""
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF).to(torch.uint8)


def unpack_columns(packed: torch.Tensor, awq_order: bool) -> torch.Tensor:
    """[rows, cols * 8]: words packing eight consecutive columns (AWQ's interleaved order, or in order)."""
    values = _values(packed)
    if awq_order:
        values = values[..., _AWQ_UNDO]
    return values.reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[rows * 8, cols]: words packing eight consecutive rows in order (GPTQ's qweight)."""
    return _values(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def awq_to_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in] uint8, z [out, groups] uint8, s [out, groups] float16) of an AWQ weight."""
    q = unpack_columns(qweight, awq_order=True).t()
    z = unpack_columns(qzeros, awq_order=True).t()
    return q.contiguous(), z.contiguous(), scales.t().to(torch.float16).contiguous()


def gptq_to_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in], z [out, groups] with the v1 "+1" applied, s [out, groups]) of a GPTQ weight,
    its input columns in the checkpoint's order (see `act_order_permutation`)."""
    q = unpack_rows(qweight).t()
    z = unpack_columns(qzeros, awq_order=False).t() + 1
    return q.contiguous(), z.contiguous(), scales.t().to(torch.float16).contiguous()


def act_order_permutation(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input column order that makes each group contiguous (None: already in order), checking that
    g_idx assigns exactly `group` columns to each group."""
    g_idx = g_idx.to(torch.int64)
    groups = g_idx.numel() // group
    counts = torch.bincount(g_idx, minlength=groups) if g_idx.numel() and g_idx.min() >= 0 else None
    if counts is None or counts.numel() != groups or bool((counts != group).any()):
        raise ValueError(f"g_idx does not assign {group} input columns to each of {groups} groups")
    perm = torch.argsort(g_idx, stable=True)
    return None if torch.equal(perm, torch.arange(g_idx.numel())) else perm


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] in the kernels' chunk layout from values q [out, in] (in a multiple of 32)."""
    chunks = q.to(torch.uint8).reshape(q.shape[0], -1, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


def packed_shapes(awq: bool, k: int, n: int, group: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of a [n, k] weight (`in` = k) and their shapes, in AWQ's or GPTQ's layout."""
    shapes = {
        "qweight": (k, n // 8) if awq else (k // 8, n),
        "qzeros": (k // group, n // 8),
        "scales": (k // group, n),
    }
    return shapes if awq else {**shapes, "g_idx": (k,)}


def checkpoint_problem(
    config: Int4QuantizationConfig, prefix: str, tensors: CheckpointTensors
) -> str | None:
    """What is wrong with the packed tensors of module `prefix` in a checkpoint (`{name: (file,
    shape)}`), naming the tensor; None when they are a readable weight."""
    awq = config.name == "awq"
    shape = tensors[f"{prefix}.qweight"][1]
    if len(shape) != 2:
        return f"tensor '{prefix}.qweight' has shape {shape}, not 2-D"
    k, n = (shape[0], shape[1] * 8) if awq else (shape[0] * 8, shape[1])
    group = config.group_for(k)
    if k % group:
        return (
            f"tensor '{prefix}.qweight': group_size {group} does not divide its input width {k} "
            f"({config.name.upper()} groups must tile the input)"
        )
    for part, expected in packed_shapes(awq, k, n, group).items():
        name = f"{prefix}.{part}"
        if name not in tensors:
            return (
                f"tensor '{name}' is missing (the {config.name.upper()} weight '{prefix}.qweight' needs it)"
            )
        if tuple(tensors[name][1]) != expected:
            return f"tensor '{name}' has shape {tensors[name][1]}, expected {list(expected)} for group_size {group}"
    return None
