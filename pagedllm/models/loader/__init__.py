"""Build a model and fill its weights: `get_model(engine_config)` (the runner's entry point) and
`load_model(...)` (the same with plain arguments, for tests and tools).

The model is constructed on the target device with the target dtype as the default (so each layer,
or its quantization method, creates its parameters in the dtype it keeps them in: nothing casts the
model afterwards, which would also cast quantized storage), its parameters uninitialized
(`torch.empty` touches no memory), and then each checkpoint tensor is copied once into its parameter
by the generic loop of `weights.py` (fused q/k/v and gate/up included), so no full-size temporary
copy of the model ever exists. Layers with a quantization method then finish their weights
(`process_weights_after_loading`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import check_tensor_parallel_size
from pagedllm.errors import ModelLoadError
from pagedllm.formats.model_source import download_model_files, hub_weight_patterns
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.loader.dummy import initialize_dummy_weights
from pagedllm.models.loader.gguf_loader import (
    apply_rope_freq_factors,
    gguf_architecture,
    iterate_gguf,
    read_header,
    rope_freq_factors,
)
from pagedllm.models.loader.quantization import resolve_quant_config
from pagedllm.models.loader.safetensors_loader import iterate_safetensors, safetensors_files
from pagedllm.models.loader.safetensors_loader import read_header as read_safetensors_header
from pagedllm.models.loader.weights import accepts, load_weights
from pagedllm.models.registry import resolve_model_cls
from pagedllm.quant_interface import QuantizationConfig, QuantizeMethodBase

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

__all__ = [
    "ModelLoadError",
    "default_dtype",
    "effective_quant_config",
    "get_model",
    "load_model",
    "reload_weights",
]

SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def _weights(
    load_format: str,
    model_path: Path,
    gguf_file: Path | None,
    keep_packed: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Check the files exist and are readable now, then return the lazy tensor iterator (GGUF
    tensors whose packed name `keep_packed` accepts stay as stored)."""
    if load_format == "gguf":
        if gguf_file is None:
            raise ModelLoadError(f"load_format='gguf' but {model_path} has no .gguf file")
        gguf_architecture(read_header(gguf_file), gguf_file)
        return iterate_gguf(gguf_file, keep_packed)
    return iterate_safetensors(safetensors_files(model_path))


def _check_quantized_checkpoint(model_path: Path, quant_config: QuantizationConfig) -> None:
    """Refuse a safetensors checkpoint whose tensors `quant_config` cannot read (from the headers,
    before the model is built), naming the file and the tensor."""
    shapes = {
        name: (path, info[1], info[0])
        for path in safetensors_files(model_path)
        for name, info in read_safetensors_header(path)[0].items()
    }
    try:
        quant_config.check_checkpoint(shapes)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def _source(
    load_format: str, model_path: Path | str, gguf_file: Path | str | None
) -> tuple[str, Path, Path | None]:
    """`(load format with "auto" resolved, model directory, GGUF file or None)`."""
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
    return load_format, model_path, gguf_path


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are `dtype` by default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


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
    quant_config: QuantizationConfig | None = None,
) -> nn.Module:
    """The model for `hf_config` with weights from `model_path` (an HF directory) or `gguf_file`,
    in `dtype` on `device`, in eval mode, its rotary tables covering at least `max_positions`, each
    linear layer with the method `quant_config` chooses for it (unquantized without one)."""
    check_tensor_parallel_size(tensor_parallel_size)
    load_format, model_path, gguf_path = _source(load_format, model_path, gguf_file)
    model_cls = resolve_model_cls(list(getattr(hf_config, "architectures", None) or []))
    if load_format == "dummy":
        quant_config = None  # random weights have no packed blocks: dense layers of the same shapes
    elif load_format != "gguf" and quant_config is not None:
        _check_quantized_checkpoint(model_path, quant_config)

    with torch.device(device), default_dtype(dtype):
        model = model_cls(hf_config, quant_config=quant_config)
    keep_packed = accepts(model) if quant_config is not None else None
    weights = None if load_format == "dummy" else _weights(load_format, model_path, gguf_path, keep_packed)
    # Buffers computed on the CPU whatever the device context (the rotary tables) move to the device;
    # parameters are already there (no copy, no dtype change).
    model.to(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cover_positions(max_positions)
    if weights is None:
        initialize_dummy_weights(model, seed)
    else:
        checkpoint = str(gguf_path if load_format == "gguf" else model_path)
        with torch.no_grad():
            try:
                load_weights(model, weights)
            except ModelLoadError as e:
                # Name the checkpoint (an error found while reading one of its files names that file).
                message = str(e)
                raise ModelLoadError(
                    message if checkpoint in message else f"{checkpoint}: {message}"
                ) from None
        if load_format == "gguf":
            assert gguf_path is not None
            factors = rope_freq_factors(gguf_path)
            if factors is not None:
                apply_rope_freq_factors(model, factors)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
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


def _model_path(engine_config: EngineConfig) -> Path:
    mc, lc = engine_config.model_config, engine_config.load_config
    if getattr(mc, "source_kind", None) == "hub" and lc.load_format != "dummy":
        return _download_hub_weights(mc, lc)
    return Path(mc.model_path)


def reload_weights(model: nn.Module, engine_config: EngineConfig) -> None:
    """Fill `model`'s (reallocated) parameters again from the configured checkpoint (sleep mode level 2
    wake-up). Unquantized weights only: a quantization method's post-load processing is not repeatable."""
    if effective_quant_config(engine_config) is not None:
        raise ModelLoadError("reloading the weights of a quantized model is not supported")
    mc = engine_config.model_config
    load_format, model_path, gguf_path = _source(
        engine_config.load_config.load_format, _model_path(engine_config), mc.gguf_file
    )
    with torch.no_grad():
        if load_format == "dummy":
            initialize_dummy_weights(model, mc.seed)
        else:
            load_weights(model, _weights(load_format, model_path, gguf_path))


def get_model(engine_config: EngineConfig) -> nn.Module:
    """The configured model with its weights, on the configured device, in eval mode."""
    mc = engine_config.model_config
    pp = engine_config.parallel_config.pipeline_parallel_size
    model_cls = resolve_model_cls(list(getattr(mc.hf_config, "architectures", None) or []))
    if pp != 1 and not getattr(model_cls, "supports_pp", False):
        raise ModelLoadError(f"{model_cls.__name__} does not support pipeline_parallel_size > 1 (got {pp})")
    model_path = _model_path(engine_config)
    quant_config = effective_quant_config(engine_config)
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
        quant_config=quant_config,
    )


def effective_quant_config(engine_config: EngineConfig) -> QuantizationConfig | None:
    """The quantization the loaded model runs: the config's `quant_config` if given, else the method its
    model config names (resolved here), but None for a GGUF file whose tensors are dequantized to the
    model dtype at load (the default, `gguf_dequantize`)."""
    quant_config = engine_config.quant_config or resolve_quant_config(engine_config.model_config)
    if (
        quant_config is not None
        and quant_config.name == "gguf"
        and gguf_dequantize(engine_config.load_config)
    ):
        return None
    return quant_config


def gguf_dequantize(load_config: Any) -> bool:
    """Whether a GGUF file's weights load dequantized to the model dtype (the float path).

    The default until the block kernels beat it: on the machines measured so far the float path's
    prompt GEMMs and its native single-sequence decode path are faster than running from the blocks
    (benchmarks/RESULTS.md, issue 19). `model_loader_extra_config={"gguf_dequantize": false}` runs
    the blocks as stored (a quarter to a half of the memory)."""
    return bool(load_config.model_loader_extra_config.get("gguf_dequantize", True))
