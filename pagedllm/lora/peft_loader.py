"""Read a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors` or `.bin`).

What it accepts: LoRA weights on the attention and MLP projections (q/k/v/o, gate/up/down, and the fused
qkv_proj / gate_up_proj some checkpoints use), any rank (checked against `max_lora_rank` by the
caller), `lora_alpha` with `alpha_pattern`/`rank_pattern` overrides (keyed by module names), and rsLoRA
scaling. What PEFT can save but is not served is refused by name: trained embeddings or LM head
(`modules_to_save`, LoRA on the embeddings, an extended vocabulary), trained biases, DoRA. A malformed
adapter (unreadable files, wrong types, non-finite weights) is a `LoRAAdapterError` naming the file and
the field or tensor, never another exception. The scaling is folded into B here, so the layers only ever
compute `x @ A^T @ B^T`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# HF projection names an adapter may target (the fused ones as some checkpoints name them).
SUPPORTED_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
# `base_model.model.<module>.lora_A[.<adapter name>].weight`
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Every file of an adapter directory the loader opens or looks for.
ADAPTER_FILES = ("adapter_config.json", *_WEIGHT_FILES, "new_embeddings.safetensors", "new_embeddings.bin")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served, with the reason."""


@dataclass
class LoRAModuleWeights:
    """One projection's adapter: `delta(x) = x @ a.T @ b.T`, the scaling already in `b`."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """A loaded adapter: HF module name (e.g. `model.layers.0.self_attn.q_proj`) -> its weights."""

    path: str
    rank: int
    modules: dict[str, LoRAModuleWeights]

    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


# What a module name (or a dotted suffix of one) is made of. PEFT compiles every alpha_pattern /
# rank_pattern key as a regular expression, `(.*\.)?(key)$`; a crafted key backtracks for hours (Python's
# `re` has no time bound), so keys are matched literally, which is PEFT's meaning for a module name.
_MODULE_NAME = re.compile(r"[\w.]+")


def _pattern_value(path: Path, field: str, patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: the first key naming the module or a dotted suffix of its name."""
    for key, value in patterns.items():
        if _MODULE_NAME.fullmatch(key) is None:
            raise LoRAAdapterError(
                f"LoRA adapter {str(path)!r}: {field} key {key[:80]!r} is a regular expression; pagedllm "
                "matches module names only (such as 'down_proj' or 'model.layers.3.mlp.down_proj')"
            )
        if module == key or module.endswith(f".{key}"):
            return value
    return default


def _config_value(
    path: Path, config: dict[str, Any], key: str, default: Any, kind: type | tuple[type, ...]
) -> Any:
    value = config.get(key, default)
    if value is None:
        return default
    # bool is an int to isinstance: a flag is no number, and a number no flag.
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise LoRAAdapterError(
            f"LoRA adapter {str(path)!r}: adapter_config.json {key}={value!r} has the wrong type"
        )
    return value


def read_adapter_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, OSError) as e:  # not UTF-8, not JSON, unreadable
        raise LoRAAdapterError(f"LoRA adapter {str(config_file)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {str(config_file)!r} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: peft_type {peft_type!r} is not LORA")
    refused = {
        "modules_to_save": "trained embeddings or LM head (modules_to_save)",
        "use_dora": "DoRA (use_dora)",
        "lora_bias": "trained LoRA biases (lora_bias)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"LoRA adapter {str(path)!r}: bias={config['bias']!r} (trained biases) is not supported; "
            "only 'none'"
        )
    if (path / "new_embeddings.safetensors").exists() or (path / "new_embeddings.bin").exists():
        raise LoRAAdapterError(
            f"LoRA adapter {str(path)!r}: extra vocabulary (new_embeddings) is not supported"
        )
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        file = path / name
        if file.is_file():
            try:
                if file.suffix == ".safetensors":
                    from safetensors.torch import load_file

                    tensors = load_file(str(file))
                else:
                    tensors = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:  # truncated, corrupted or not a weights file at all: the file is at fault
                raise LoRAAdapterError(f"LoRA adapter weights {str(file)!r} cannot be read: {e}") from None
            if not isinstance(tensors, dict) or not all(
                isinstance(t, torch.Tensor) for t in tensors.values()
            ):
                raise LoRAAdapterError(f"LoRA adapter weights {str(file)!r} are not a dict of tensors")
            return tensors
    raise LoRAAdapterError(f"LoRA adapter {str(path)!r} has none of {', '.join(_WEIGHT_FILES)}")


def _check_tensor(path: Path, key: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2 or tensor.numel() == 0:
        raise LoRAAdapterError(
            f"LoRA adapter {str(path)!r}: {key} has shape {tuple(tensor.shape)}, not a non-empty matrix"
        )
    if not tensor.is_floating_point():
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: {key} holds {tensor.dtype}, not floating point")
    if not bool(torch.isfinite(tensor).all()):
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: {key} holds NaN or infinite values")


def load_peft_adapter(path: str | Path, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """The adapter at `path`, its B matrices scaled, every tensor in `dtype` on the CPU."""
    path = Path(path)
    config = read_adapter_config(path)
    tensors = _read_weights(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {str(path)!r}: weight {key!r} is not a LoRA A/B matrix of a projection "
                "(embeddings, LM head and biases are not supported)"
            )
        _check_tensor(path, key, tensor)
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    alpha = config.get("lora_alpha", 8)
    use_rslora = _config_value(path, config, "use_rslora", False, bool)
    alpha_pattern = _config_value(path, config, "alpha_pattern", {}, dict)
    rank_pattern = _config_value(path, config, "rank_pattern", {}, dict)
    modules: dict[str, LoRAModuleWeights] = {}
    for module, ab in pairs.items():
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_TARGETS:
            raise LoRAAdapterError(
                f"LoRA adapter {str(path)!r}: target module {leaf!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_TARGETS)})"
            )
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {str(path)!r}: {module} lacks lora_{'AB'[('A' in ab)]}")
        a, b = ab["A"], ab["B"]
        rank = int(a.shape[0])
        if b.shape[1] != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {str(path)!r}: {module} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, "
                "not [r, in] and [out, r]"
            )
        declared = _pattern_value(path, "rank_pattern", rank_pattern, module, config.get("r", rank))
        if declared != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {str(path)!r}: {module} has rank {rank} but the config says r={declared}"
            )
        module_alpha = _pattern_value(path, "alpha_pattern", alpha_pattern, module, alpha)
        if (
            isinstance(module_alpha, bool)
            or not isinstance(module_alpha, int | float)
            or not math.isfinite(module_alpha)
        ):
            raise LoRAAdapterError(
                f"LoRA adapter {str(path)!r}: {module} has lora_alpha {module_alpha!r}, not a number"
            )
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        modules[module] = LoRAModuleWeights(
            a=a.to(dtype).contiguous(), b=(b.to(torch.float32) * scaling).to(dtype).contiguous()
        )
    if not modules:
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} holds no LoRA weights")
    return LoRAAdapter(str(path), max(w.rank for w in modules.values()), modules)
