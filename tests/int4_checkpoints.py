"""AWQ and GPTQ checkpoints packed in the test, as AutoAWQ (GEMM version) and AutoGPTQ / GPTQModel
(v1 "gptq" format) write them, from random 4-bit weights; and their dequantized float weights, the
reference. Written from those packers' loops, independently of pagedllm's readers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

# AutoAWQ's WQLinear_GEMM: word value i holds output column ORDER[i] of its eight.
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits as int32 (the wrap numpy's uint32 -> int32 view does)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_columns(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[rows, cols] 4-bit values -> int32 [rows, cols / 8], word value i = column 8c + order[i]."""
    values = values.to(torch.int64)
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order[i]] << (4 * i)
    return _int32(packed)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit values -> int32 [rows / 8, cols], word value j = row 8r + j (GPTQ qweight)."""
    values = values.to(torch.int64)
    packed = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for row in range(packed.shape[0]):
        for j in range(8):
            packed[row] |= values[row * 8 + j] << (4 * j)
    return _int32(packed)


@dataclass
class Packed:
    tensors: dict[str, torch.Tensor]  # qweight, qzeros, scales (and g_idx), as the checkpoint has them
    dequantized: torch.Tensor  # W [out, in] float32


def act_order_g_idx(in_features: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ's g_idx with act-order: the columns quantized in a random order, `group` at a time."""
    order = torch.randperm(in_features, generator=gen)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group).to(torch.int32)
    return g_idx


def random_packed(
    fmt: str,
    out_features: int,
    in_features: int,
    group: int,
    g_idx: torch.Tensor | None,
    gen: torch.Generator,
) -> Packed:
    """A random 4-bit weight in `fmt` ("awq" or "gptq") and its dequantized value (act-order GPTQ
    with `g_idx`, else groups in order)."""
    groups = in_features // group
    q = torch.randint(0, 16, (in_features, out_features), generator=gen)  # [in, out], as both packers hold it
    zeros = torch.randint(6, 10, (groups, out_features), generator=gen)  # z, 6..9
    scales = (0.01 + 0.02 * torch.rand(groups, out_features, generator=gen)).to(torch.float16)
    if g_idx is None:
        g_idx = (torch.arange(in_features) // group).to(torch.int32)
    rows = g_idx.long()
    dequantized = ((q - zeros[rows]).float() * scales[rows].float()).t().contiguous()
    if fmt == "awq":
        tensors = {
            "qweight": pack_columns(q, AWQ_ORDER),
            "qzeros": pack_columns(zeros, AWQ_ORDER),
            "scales": scales,
        }
    else:  # GPTQ v1 stores z - 1
        tensors = {
            "qweight": pack_rows(q),
            "qzeros": pack_columns(zeros - 1, list(range(8))),
            "scales": scales,
            "g_idx": g_idx.clone(),  # its own storage: projections share the values
        }
    return Packed(tensors, dequantized)


def quantize_checkpoint(
    float_dir: Path, out_dir: Path, fmt: str, group: int, act_order: bool = False, seed: int = 0
) -> AutoModelForCausalLM:
    """Rewrite the tiny HF model in `float_dir` as a 4-bit `fmt` checkpoint in `out_dir` (random 4-bit
    weights for every decoder linear layer, the rest as is) and return HF's model on the dequantized
    weights (the reference)."""
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    reference = dict(state)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # Act-order: one g_idx per input, shared by the projections that read it (GPTQ orders columns by
    # the input's Hessian), as q/k/v and gate/up are in real checkpoints.
    g_idx: dict[str, torch.Tensor] = {}
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        prefix = name.removesuffix(".weight")
        out_features, in_features = state.pop(name).shape
        reader = (
            prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        )
        if act_order and reader not in g_idx:
            g_idx[reader] = act_order_g_idx(in_features, group, gen)
        packed = random_packed(fmt, out_features, in_features, group, g_idx.get(reader), gen)
        state.update({f"{prefix}.{key}": t for key, t in packed.tensors.items()})
        reference[name] = packed.dequantized
    for path in [*float_dir.iterdir()]:
        if path.suffix != ".safetensors":
            (out_dir / path.name).write_bytes(path.read_bytes())
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    if fmt == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    (out_dir / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(float_dir), attn_implementation="eager")
    hf.load_state_dict(reference)
    return hf.eval()
