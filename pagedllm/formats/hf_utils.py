"""Reading transformers configs: config.json, generation_config.json, RoPE settings in either style."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Attributes that bound the context length, as different model families name them.
MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def load_hf_config(path: Path, trust_remote_code: bool, revision: str | None) -> PretrainedConfig:
    """Read config.json of a local model directory (no weights)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except (ValueError, OSError) as e:  # not JSON (transformers says OSError), an unknown model type
        raise ModelLoadError(f"cannot read the model config in {path}: {e}") from None


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE settings as one dict {rope_theta, rope_type, factor, ...} for old and new config styles,
    the one reading of them (the model's rotary embedding and the derived context length).

    transformers >= 5 keeps them in `rope_parameters`; older configs have `rope_theta` plus an optional
    `rope_scaling` dict (with "type" or "rope_type"). Models whose layer types rotate differently
    (Gemma 3: a local and a global base) keep one dict per type there
    (`{"sliding_attention": {...}, "full_attention": {...}}`): `layer_type` picks one. A scaled
    rope type also gets the config's top-level `original_max_position_embeddings` (where Phi-3 keeps
    it) unless its own dict states one."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and params:
        merged = dict(params)
        merged.setdefault("rope_theta", getattr(config, "rope_theta", None))
    else:
        merged = dict(getattr(config, "rope_scaling", None) or {})
        merged["rope_theta"] = getattr(config, "rope_theta", None)
    if merged["rope_theta"] is None:
        del merged["rope_theta"]
    if "type" in merged:
        legacy = merged.pop("type")
        merged.setdefault("rope_type", legacy)
    merged.setdefault("rope_type", "default")
    if merged["rope_type"] == "su":  # the name Phi-3's first configs gave LongRoPE
        merged["rope_type"] = "longrope"
    original = getattr(config, "original_max_position_embeddings", None)
    if merged["rope_type"] != "default" and original is not None:
        merged.setdefault("original_max_position_embeddings", original)
    return merged


def rope_theta(config: PretrainedConfig) -> float | None:
    value = rope_parameters(config).get("rope_theta")
    return None if value is None else float(value)


def rope_scaling(config: PretrainedConfig) -> dict[str, Any] | None:
    """The scaling part of the RoPE settings, None for plain RoPE."""
    params = {k: v for k, v in rope_parameters(config).items() if k != "rope_theta"}
    return None if params.get("rope_type") == "default" and len(params) == 1 else params


def derived_max_model_len(config: PretrainedConfig) -> tuple[int, str]:
    """The model's own context limit and the attribute it came from."""
    best: tuple[int, str] | None = None
    for key in MAX_LEN_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0 and (best is None or value < best[0]):
            best = (value, key)
    if best is None:
        # Same fallback as upstream: a config without a length bound is treated as 2048 tokens.
        return 2048, "default"
    length, key = best
    scaling = rope_scaling(config)
    # Long-RoPE/llama3 configs already state the extended length; the others scale the original one.
    if scaling is not None and scaling.get("rope_type") not in ("longrope", "llama3", "default"):
        factor = scaling.get("factor")
        if isinstance(factor, (int, float)) and factor > 1:
            if scaling.get("rope_type") == "yarn" and "original_max_position_embeddings" in scaling:
                length = int(scaling["original_max_position_embeddings"])
            length = int(length * factor)
            key = f"{key} x rope factor {factor}"
    return length, key


def read_generation_config(path: Path | None) -> dict[str, Any]:
    """The generation_config.json of a model directory as a dict ({} when absent)."""
    if path is None:
        return {}
    file = path / "generation_config.json" if path.is_dir() else path
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e


# The safetensors format caps its JSON header at 100 MB; a larger length means a corrupt file.
_MAX_SAFETENSORS_HEADER = 100 * 2**20


def safetensors_weight_names(path: Path) -> set[str] | None:
    """Tensor names of a directory's safetensors checkpoint from its index or headers (no data).

    None when there is no checkpoint or it cannot be read: the config only uses the names for a
    hint (untying embeddings), and the weight loader reports a corrupt checkpoint with its own error,
    so a bad header must neither fail config construction nor make it read the tensor data."""
    try:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return set(weight_map) if isinstance(weight_map, dict) else None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return None
        names: set[str] = set()
        for file in files:
            with open(file, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if not 0 < header_len <= _MAX_SAFETENSORS_HEADER:
                    return None
                header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                return None
            names.update(k for k in header if k != "__metadata__")
        return names
    except (OSError, ValueError, AttributeError):
        return None
