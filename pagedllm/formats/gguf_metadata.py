"""A fast reader of a GGUF file's header (key/value metadata and where each tensor lies), no tensor data.

`gguf.GGUFReader` builds numpy views of every field and tensor (2.4 s on the 100 MB SmolLM2 file) and
`AutoConfig.from_pretrained(gguf_file=...)` takes ~10 s; configs must build in milliseconds, and the
weight loader reads the tensors from the offsets found here. So this walks the header once with
`struct`, skips the big tokenizer arrays by arithmetic (numeric arrays) or by length prefixes only
(string arrays), and maps the architecture keys onto a transformers config.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GGUF_MAGIC = b"GGUF"

# GGUF value type id -> (struct format, byte size) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING = 8
_ARRAY = 9
# Arrays longer than this are tokenizer tables (tokens, scores, merges): skipped, only counted.
_MAX_KEPT_ARRAY = 256


@dataclass(frozen=True)
class SkippedArray:
    """Placeholder for a large array that was skipped; `count` elements of GGUF type `item_type`."""

    item_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where a tensor's bytes lie: `dims` in GGUF order (fastest-varying first), `ggml_type` the
    `gguf.GGMLQuantizationType` value, `offset` from the start of the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def count(self, what: str, item_bytes: int, type_id: int = 10) -> int:
        """A count (a uint64 unless `type_id` says otherwise) read from the file, refused when its items
        (each at least `item_bytes`) could not fit in the rest of the file: a corrupt count would
        otherwise loop for ages or overflow."""
        value = self.scalar(type_id)
        if value * item_bytes > len(self.buf) - self.pos:
            raise _Corrupt(f"it claims {value} {what}, more than the file's {len(self.buf)} bytes can hold")
        return int(value)

    def scalar(self, type_id: int) -> Any:
        fmt, size = _SCALARS[type_id]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.count("bytes of a string", 1)
        start = self.pos
        self.pos = start + length
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack = self.buf, self.pos, struct.unpack_from
        for _ in range(count):
            pos += 8 + unpack("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type = self.scalar(4)
            count = self.count("array items", _SCALARS[item_type][1] if item_type in _SCALARS else 8)
            if count > _MAX_KEPT_ARRAY:
                if item_type == _STRING:
                    self.skip_strings(count)
                elif item_type in _SCALARS:
                    self.pos += count * _SCALARS[item_type][1]
                else:
                    raise _Corrupt(f"it has a nested array of type {item_type}, which cannot be skipped")
                return SkippedArray(item_type, count)
            return [self.value(item_type) for _ in range(count)]
        if type_id not in _SCALARS:
            raise _Corrupt(f"unknown metadata value type {type_id}")
        return self.scalar(type_id)


class _Corrupt(Exception):
    """A header that cannot be what it claims; `read_gguf_header` names the file."""


@functools.lru_cache(maxsize=16)
def _read_header_cached(path: str, mtime_ns: int, size: int) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.scalar(4)
        if version == 1:
            raise ModelLoadError(f"{path}: GGUF version 1 is not supported (re-convert the model)")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: unknown GGUF version {version} (supported: 2, 3)")
        # The smallest tensor entry: an empty name, no dimension, a type and an offset.
        tensor_count = cur.count("tensors", 8 + 4 + 4 + 8)
        # The smallest key/value entry: an empty key, a value type and a one-byte value.
        kv_count = cur.count("metadata entries", 8 + 4 + 1)
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar(4))
        raw = []
        for _ in range(tensor_count):
            name = cur.string()
            dims = tuple(
                cur.scalar(10) for _ in range(cur.count(f"dimensions of tensor {name!r}", 8, type_id=4))
            )
            raw.append((name, dims, cur.scalar(4), cur.scalar(10)))
        # Tensor data starts at the next multiple of the alignment after the header.
        align = int(metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        tensors = tuple(GGUFTensorInfo(n, d, t, data_start + off) for n, d, t, off in raw)
        return GGUFHeader(version=version, metadata=metadata, tensors=tensors)


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse (and cache per file version) the header of the GGUF file at `path`."""
    try:
        stat = path.stat()
        return _read_header_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except ModelLoadError:
        raise
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e})") from None
    except (struct.error, IndexError, OverflowError, ValueError, _Corrupt) as e:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF header ({e})") from None


# pagedllm model type -> (transformers config class name, architecture class name). Names, not classes:
# importing transformers costs about a second, paid only when a GGUF config is built.
_GGUF_CONFIGS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
# Granite's multipliers: GGUF key suffix -> config attribute.
_GRANITE_KEYS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}

# GGUF key suffix (after "<arch>.") -> transformers config attribute, per model type.
_COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_HEAD_DIM_KEY = {
    "llama": "rope.dimension_count",
    "mistral": "rope.dimension_count",
    "mixtral": "rope.dimension_count",
    "qwen3": "attention.key_length",
    "gemma2": "attention.key_length",
    "gemma3": "attention.key_length",
    "qwen3moe": "attention.key_length",
}
# What llama.cpp does not store for Gemma 3: the base of the sliding-window layers' rotation, and
# the pattern of its layers (every sixth one global), both fixed in its code.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_GLOBAL_EVERY = 6
# Mixture-of-experts keys, per model type (Mixtral's experts are `feed_forward_length` wide).
_QWEN_MOE_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_MOE_KEYS = {
    "qwen2moe": _QWEN_MOE_KEYS,
    "qwen3moe": _QWEN_MOE_KEYS,
    "mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
}
# Whether llama.cpp renormalizes the top-k router weights of these when the file has no
# `expert_weights_norm` key (its converters write none for them).
_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}
_TOKEN_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

SUPPORTED_GGUF_ARCHITECTURES = tuple(_GGUF_CONFIGS)


def gguf_model_type(header: GGUFHeader) -> str:
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("GGUF file has no general.architecture key")
    name = str(header.metadata.get("general.name", "")).lower()
    # llama.cpp stores Mixtral and Mistral models as "llama"; experts, else the model name, tell them apart.
    if arch == "llama" and header.metadata.get("llama.expert_count"):
        return "mixtral"
    if arch == "llama" and "mistral" in name:
        return "mistral"
    return arch


def hf_config_from_gguf(header: GGUFHeader) -> PretrainedConfig:
    """The transformers config (of `SUPPORTED_GGUF_ARCHITECTURES`) described by a GGUF header."""
    meta = header.metadata
    arch = meta["general.architecture"]
    model_type = gguf_model_type(header)
    if model_type not in _GGUF_CONFIGS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    import transformers

    config_name, architecture = _GGUF_CONFIGS[model_type]
    kwargs: dict[str, Any] = {}
    for suffix, attr in (_COMMON_KEYS | _MOE_KEYS.get(model_type, {})).items():
        if f"{arch}.{suffix}" in meta:
            kwargs[attr] = meta[f"{arch}.{suffix}"]
    head_key = _HEAD_DIM_KEY.get(model_type)
    if head_key is not None and f"{arch}.{head_key}" in meta:
        kwargs["head_dim"] = meta[f"{arch}.{head_key}"]
    if "vocab_size" not in kwargs:
        tokens = meta.get("tokenizer.ggml.tokens")
        if isinstance(tokens, SkippedArray):
            kwargs["vocab_size"] = tokens.count
        elif isinstance(tokens, list):
            kwargs["vocab_size"] = len(tokens)
    for key, attr in _TOKEN_KEYS.items():
        if key in meta:
            kwargs[attr] = meta[key]
    rope: dict[str, Any] = {"rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope["rope_type"] = scaling_type
        rope["factor"] = float(meta[f"{arch}.rope.scaling.factor"])
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
    else:
        rope["rope_type"] = "default"
    kwargs["rope_parameters"] = rope
    sliding = meta.get(f"{arch}.attention.sliding_window")
    if sliding is not None and model_type in (
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "phi3",
    ):
        kwargs["sliding_window"] = sliding
    if model_type in ("gemma2", "gemma3"):
        _gemma_kwargs(model_type, meta, kwargs)
    if model_type == "phi3":
        _phi3_kwargs(header, kwargs)
    if model_type == "granite":
        kwargs |= {
            attr: float(meta[f"{arch}.{key}"])
            for key, attr in _GRANITE_KEYS.items()
            if f"{arch}.{key}" in meta
        }
    if model_type in _NORM_TOPK_PROB:
        kwargs["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK_PROB[model_type]))
    # As transformers decides: no separate output projection in the file -> tied embeddings.
    kwargs["tie_word_embeddings"] = "output.weight" not in header.tensor_names
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [architecture]
    config._name_or_path = str(meta.get("general.name", ""))
    return config


def _phi3_kwargs(header: GGUFHeader, kwargs: dict[str, Any]) -> None:
    """Phi-3's pre-training length; LongRoPE models (128k) carry their factors as tensors
    (`rope_factors_long/short`), which the config cannot read yet: refused."""
    if any(name.startswith("rope_factors_") for name in header.tensor_names):
        raise ValueError(
            "GGUF phi3 files with LongRoPE factors (rope_factors_long/short) are not supported yet"
        )
    original = header.metadata.get("phi3.rope.scaling.original_context_length")
    kwargs["original_max_position_embeddings"] = int(original or kwargs["max_position_embeddings"])
    # transformers' Phi3Config wants the rotated fraction of each head stated.
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    rotary = header.metadata.get("phi3.rope.dimension_count", head_dim)
    kwargs["rope_parameters"]["partial_rotary_factor"] = int(rotary) / head_dim


def _gemma_kwargs(model_type: str, meta: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Gemma's settings as llama.cpp stores or implies them: the soft caps, the query scale (llama.cpp
    uses head_dim^-0.5, except hidden/heads for Gemma 2 27B, its only 46-layer model), Gemma 3's
    layer pattern and its per-layer-type rotation (the file's base and scaling are the global layers')."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.get(f"{model_type}.{key}")
        kwargs[key] = None if value is None else float(value)
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if model_type == "gemma2" and kwargs.get("num_hidden_layers") == 46:
        kwargs["query_pre_attn_scalar"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    else:
        kwargs["query_pre_attn_scalar"] = head_dim
    if model_type == "gemma3":
        kwargs["layer_types"] = [
            "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
            for i in range(kwargs["num_hidden_layers"])
        ]
        kwargs["rope_parameters"] = {
            "full_attention": kwargs["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        }


def gguf_chat_template(header: GGUFHeader) -> str | None:
    template = header.metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None
