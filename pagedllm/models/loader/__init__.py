"""Build a model and fill its weights: `get_model(engine_config)` (the runner's entry point) and
`load_model(...)` (the same with plain arguments, for tests and tools).

The model is constructed on the meta device (no memory), given uninitialized storage on the target
device with `to_empty`, and then each checkpoint tensor is copied once into its parameter (fused
q/k/v and gate/up included), so no full-size temporary copy of the model ever exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.config.model_source import download_model_files, hub_weight_patterns
from pagedllm.layers.linear import check_tp_size
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.loader.dummy import initialize_dummy_weights
from pagedllm.models.loader.errors import ModelLoadError
from pagedllm.models.loader.gguf_loader import (
    apply_rope_freq_factors,
    gguf_architecture,
    iterate_gguf,
    read_header,
    rope_freq_factors,
)
from pagedllm.models.loader.safetensors_loader import iterate_safetensors, safetensors_files
from pagedllm.models.registry import resolve_model_cls

__all__ = ["ModelLoadError", "get_model", "load_model"]

SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def _weights(
    load_format: str, model_path: Path, gguf_file: Path | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Check the files exist and are readable now, then return the lazy tensor iterator."""
    if load_format == "gguf":
        if gguf_file is None:
            raise ModelLoadError(f"load_format='gguf' but {model_path} has no .gguf file")
        gguf_architecture(read_header(gguf_file), gguf_file)
        return iterate_gguf(gguf_file)
    return iterate_safetensors(safetensors_files(model_path))


def load_model(
    hf_config: Any,
    model_path: Path | str,
    gguf_file: Path | str | None = None,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int | None = 0,
    tensor_parallel_size: int = 1,
    max_positions: int = 0,
) -> nn.Module:
    """The model for `hf_config` with weights from `model_path` (an HF directory) or `gguf_file`,
    in `dtype` on `device`, in eval mode, its rotary tables covering at least `max_positions`."""
    check_tp_size(tensor_parallel_size)
    if load_format not in SUPPORTED_LOAD_FORMATS:
        raise ModelLoadError(
            f"load_format={load_format!r} is not supported (supported: {', '.join(SUPPORTED_LOAD_FORMATS)})"
        )
    model_path = Path(model_path)
    gguf_path = None if gguf_file is None else Path(gguf_file)
    if gguf_path is not None and not gguf_path.is_absolute() and not gguf_path.exists():
        gguf_path = model_path / gguf_path
    if load_format == "auto":
        load_format = "gguf" if gguf_path is not None else "safetensors"
    model_cls = resolve_model_cls(list(getattr(hf_config, "architectures", None) or []))
    weights = None if load_format == "dummy" else _weights(load_format, model_path, gguf_path)

    with torch.device("meta"):
        model = model_cls(hf_config)
    model = model.to(dtype).to_empty(device=device)
    for module in model.modules():
        # Non-persistent buffers (rotary tables) are left uninitialized by to_empty.
        init = getattr(module, "init_buffers", None)
        if callable(init):
            init()
        if isinstance(module, RotaryEmbedding):
            module.cover_positions(max_positions)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    if weights is None:
        initialize_dummy_weights(model, seed)
    else:
        with torch.no_grad():
            model.load_weights(weights)  # type: ignore[operator]
        if load_format == "gguf":
            assert gguf_path is not None
            factors = rope_freq_factors(gguf_path)
            if factors is not None:
                apply_rope_freq_factors(model, factors)
    return model.eval()


def _download_hub_weights(model_config: Any, load_config: Any) -> Path:
    """Fetch a Hub model's weights: config construction fetched only its metadata files. Same
    revision and download dir, so they land in the snapshot the config was read from."""
    download_dir = load_config.download_dir or model_config.download_dir
    try:
        return download_model_files(
            model_config.model,
            model_config.revision,
            download_dir,
            hub_weight_patterns(Path(model_config.model_path)),
            ignore_patterns=list(load_config.ignore_patterns) or None,
        )
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def get_model(engine_config: Any) -> nn.Module:
    """The configured model with its weights, on the configured device, in eval mode."""
    mc = engine_config.model_config
    lc = engine_config.load_config
    if engine_config.parallel_config.pipeline_parallel_size != 1:
        raise ModelLoadError("pipeline_parallel_size > 1 is not supported by the model loader yet")
    model_path = Path(mc.model_path)
    if getattr(mc, "source_kind", None) == "hub" and lc.load_format != "dummy":
        model_path = _download_hub_weights(mc, lc)
    return load_model(
        mc.hf_config,
        model_path,
        gguf_file=mc.gguf_file,
        load_format=engine_config.load_config.load_format,
        dtype=mc.dtype,
        device=engine_config.device_config.device,
        seed=mc.seed,
        tensor_parallel_size=engine_config.parallel_config.tensor_parallel_size,
        max_positions=mc.max_model_len,
    )
