"""LoRA options of `bench throughput` (vLLM's `--lora-path` / `--max-loras` style): the same requests
spread over adapters and on the base model alone, in one run of one engine, and the ratio.

`--lora-path PATH [PATH ...]` names PEFT adapter directories; `--num-loras N` adapter ids are made from
them (cycling through the paths, as vLLM's benchmark reuses one path under several ids) and assigned
to the requests round-robin. `--lora-random-rank R` instead writes N random rank-R adapters on every
attention and MLP projection of the loaded model (PEFT's file format), for a model that has none.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--lora-path",
        nargs="+",
        default=None,
        help="PEFT LoRA adapter directories; the requests are spread over --num-loras adapters made from "
        "them and also run on the base model alone (needs --enable-lora).",
    )
    group.add_argument(
        "--num-loras",
        type=int,
        default=None,
        help="Distinct adapters the requests use (default: --max-loras).",
    )
    group.add_argument(
        "--lora-random-rank",
        type=int,
        default=None,
        help="Instead of --lora-path: write --num-loras random adapters of this rank for the model.",
    )


def _shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each targeted projection of a Llama-style decoder layer."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    q, kv_out = heads * head_dim, kv * head_dim
    return {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv_out, hidden),
        "self_attn.v_proj": (kv_out, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def write_random_adapter(hf_config: Any, path: Path, rank: int, seed: int) -> Path:
    """A rank-`rank` PEFT adapter on every projection, small enough to keep the outputs sane."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (out, inp) in _shapes(hf_config).items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_PROJECTIONS)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def lora_requests(args: argparse.Namespace, engine_config: EngineConfig) -> list[LoRARequest]:
    """The adapters of the run (empty without --lora-path / --lora-random-rank)."""
    if args.lora_path is None and args.lora_random_rank is None:
        return []
    lora_config = engine_config.lora_config
    if lora_config is None:
        raise ValueError("--lora-path / --lora-random-rank need --enable-lora")
    num = args.num_loras or lora_config.max_loras
    paths = list(args.lora_path or ())
    if args.lora_random_rank is not None:
        root = Path(tempfile.mkdtemp(prefix="pagedllm-bench-lora-"))
        hf_config = engine_config.model_config.hf_config
        paths = [
            str(write_random_adapter(hf_config, root / f"lora{i}", args.lora_random_rank, i))
            for i in range(num)
        ]
    return [LoRARequest(f"lora{i + 1}", i + 1, paths[i % len(paths)]) for i in range(num)]
