"""ModelConfig: which model, in which dtype, with which context length.

Construction resolves the model source (`pagedllm.formats.model_source`) and reads only its config (config.json, or
the GGUF header), never the weights, so a ModelConfig builds in milliseconds."""

from __future__ import annotations

import logging
from dataclasses import dataclass as plain_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import Field

from pagedllm import envs
from pagedllm.config.pooler import resolve_pooler_config
from pagedllm.config.quantization import CHECKPOINT_METHODS, ONLINE_METHODS
from pagedllm.config.utils import config, hash_fields
from pagedllm.formats import hf_utils
from pagedllm.formats.gguf_metadata import gguf_chat_template, hf_config_from_gguf, read_gguf_header
from pagedllm.formats.model_source import DEFAULT_MODEL, resolve_model_source

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagedllm.config.load import LoadConfig
    from pagedllm.config.parallel import ParallelConfig

logger = logging.getLogger("pagedllm.config")

ModelDType = Literal["auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32"]
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
# Sampling fields taken from generation_config.json, and the SamplingParams name they map to.
_GENERATION_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@plain_dataclass(frozen=True)
class ModelArchConfig:
    """The architecture numbers other components size themselves by."""

    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


def _checkpoint_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    # transformers >= 5 names it `dtype`; older configs `torch_dtype` (reading that one warns in v5).
    value = hf_config.dtype if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        return _DTYPE_NAMES.get(value)
    return value if isinstance(value, torch.dtype) else None


@config
class ModelConfig:
    """Configuration of the model."""

    model: str = DEFAULT_MODEL
    """Model: the embedded default "SmolLM2-135M-Instruct", a local HF directory, a .gguf file (or a
    directory holding one), or a Hugging Face Hub repo id."""
    tokenizer: str | None = None
    """Tokenizer name or path; unset: the model's own."""
    tokenizer_mode: Literal["auto", "hf", "slow"] = "auto"
    """"auto" uses the fast tokenizer when available."""
    tokenizer_revision: str | None = None
    """Hub revision of the tokenizer."""
    skip_tokenizer_init: bool = False
    """Do not load a tokenizer; requests must give token ids."""
    trust_remote_code: bool = False
    """Allow custom model code from the model repository."""
    dtype: ModelDType | torch.dtype = "auto"
    """Data type of weights and activations. "auto": on CPU bfloat16 where the CPU has native bf16 dot
    products (AVX512-BF16, AMX), else float32; on CUDA the checkpoint's bf16/fp16, bf16 for float32
    checkpoints."""
    seed: int | None = 0
    """Random seed of the engine (per-request seeds are separate)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the model."""
    download_dir: str | None = None
    """Directory Hub models are downloaded to (default: the Hugging Face cache)."""
    max_model_len: Annotated[int, Field(gt=0)] | None = None
    """Context length (prompt plus output); unset: the model's maximum."""
    quantization: Literal["gguf", "awq", "gptq", "fp8"] | None = None
    """Quantization method of the weights; set automatically: "gguf" for GGUF models, "awq" / "gptq" /
    "fp8" from an HF checkpoint's `quantization_config` (naming another method than the checkpoint's is
    an error). "fp8" on an unquantized checkpoint: its linear layers stored as fp8 e4m3 at load."""
    enforce_eager: bool = False
    """Run the model eagerly: no compilation, no CUDA graphs."""
    max_logprobs: Annotated[int, Field(ge=-1)] = 20
    """Most logprobs a request may ask for (-1: no limit)."""
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = (
        "raw_logprobs"
    )
    """What logprobs report: raw model output or after sampling processors, as logprobs or logits."""
    disable_sliding_window: bool = False
    """Treat sliding-window attention as full attention (context limited to the window)."""
    disable_cascade_attn: bool = False
    """Disable cascade attention (shared-prefix attention) for this model."""
    served_model_name: str | list[str] | None = None
    """Model name(s) in the API; unset: the model argument."""
    generation_config: str = "auto"
    """Sampling defaults: "auto" reads the model's generation_config.json, "vllm" uses pagedllm's own
    defaults, or a directory/file path to read generation_config.json from."""
    override_generation_config: dict[str, Any] = Field(default_factory=dict)
    """Sampling defaults that override generation_config."""
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    """Attributes set on the model's transformers config after reading it."""
    logits_processors: list[str] | None = None
    """Fully qualified names of custom logits processor classes."""
    enable_prompt_embeds: bool = False
    """Accept prompt embeddings instead of token ids."""
    enable_sleep_mode: bool = False
    """Allow the engine to release GPU memory while idle (sleep/wake)."""
    sleep_mode_backend: Literal["cumem"] = "cumem"
    """Allocator backend of sleep mode."""
    sleep_mode_offload_cudagraph: bool = False
    """Offload CUDA graphs while sleeping."""
    enable_cumem_allocator: bool = False
    """Allocate the KV cache and weights through the cuMem allocator (not supported by pagedllm)."""
    return_sampling_mask: bool = False
    """Return the mask of tokens the sampler could pick (sampling replay)."""
    enable_trace_replay: bool = False
    """Record decode traces for replay."""
    runner: Literal["auto", "generate", "pooling", "draft"] = "auto"
    """What the model runs for: "generate" text, "pooling" (embeddings, classification, scores);
    "auto": pooling for architectures named like pooling models (BertModel, *Model,
    *ForSequenceClassification) or when convert/pooler_config ask for it, else generate."""
    pooler_config: dict[str, Any] | None = None
    """Pooling settings of a pooling model: `pooling_type` (CLS, MEAN, LAST), `normalize`,
    `use_activation`, `dimensions`; unset keys come from the model (sentence-transformers' modules.json
    and Pooling config when present). After construction: the resolved settings (None: not pooling)."""
    multimodal_config: dict[str, Any] | None = None
    """Multimodal settings (image/audio inputs)."""
    convert: Literal["auto", "none", "classify", "embed"] = "auto"
    """Adapt a generative model for classification or embedding ("embed": last-token pooling)."""
    model_weights: str = ""
    """Separate location of the weights (e.g. an object-storage URI)."""

    def __post_init__(self) -> None:
        source = resolve_model_source(self.model, self.revision, self.download_dir)
        self.model_path: Path = source.path
        self.gguf_file: Path | None = source.gguf_file
        self.source_kind = source.kind
        self.chat_template: str | None = None
        if source.gguf_file is not None:
            header = read_gguf_header(source.gguf_file)
            hf_config = hf_config_from_gguf(header)
            self.chat_template = gguf_chat_template(header)
            if self.quantization not in (None, "gguf"):
                raise ValueError(f"quantization={self.quantization!r} conflicts with GGUF file {self.model!r}")
            self.quantization = "gguf"
        else:
            hf_config = hf_utils.load_hf_config(source.path, self.trust_remote_code, self.revision)
            if self.quantization == "gguf":
                raise ValueError(f"quantization='gguf' but model {self.model!r} is not a GGUF file")
            self.quantization = self._checkpoint_quantization(hf_config)
        for key, value in self.hf_overrides.items():
            setattr(hf_config, key, value)
        self.hf_config: PretrainedConfig = hf_config
        self.hf_text_config: PretrainedConfig = hf_config.get_text_config()
        self.is_submodel_config = False
        self.config_updated = False
        self.model_arch_config = self.get_model_arch_config()
        if self.tokenizer is None:
            self.tokenizer = str(source.gguf_file if source.gguf_file is not None else source.path)
        if self.served_model_name is None:
            self.served_model_name = self.model
        # generation_config.json is read once; get_diff_sampling_param and eos_token_ids reuse it.
        self._generation_file = self._generation_config_dict()
        self.dtype = self._resolve_dtype()
        self.max_model_len = self._resolve_max_model_len()
        self.pooler_config = resolve_pooler_config(
            self.runner, self.convert, self.pooler_config, hf_config, source.path
        )

    # -- construction helpers ---------------------------------------------------------------------
    def _checkpoint_quantization(self, hf_config: PretrainedConfig) -> str | None:
        """The method of an HF checkpoint: its config.json's `quantization_config.quant_method` (as
        vLLM detects it), which the `quantization` flag may name but never contradict."""
        quant = getattr(hf_config, "quantization_config", None)
        if not quant:
            if self.quantization in CHECKPOINT_METHODS and self.quantization not in ONLINE_METHODS:
                raise ValueError(
                    f"quantization={self.quantization!r} but model {self.model!r} has no quantization_config "
                    "in its config.json (an unquantized checkpoint)"
                )
            return self.quantization
        method = (
            quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        )
        method = str(method).lower()
        if method not in CHECKPOINT_METHODS:
            raise ValueError(
                f"model {self.model!r} is quantized with {method!r}, which is not supported "
                f"(supported: unquantized safetensors, GGUF, {', '.join(CHECKPOINT_METHODS)})"
            )
        if self.quantization is not None and self.quantization != method:
            raise ValueError(
                f"quantization={self.quantization!r} conflicts with model {self.model!r}, whose "
                f"config.json quantization_config says quant_method={method!r}"
            )
        return method

    def _resolve_dtype(self) -> torch.dtype:
        from pagedllm.platforms import current_platform

        if isinstance(self.dtype, torch.dtype):
            dtype = self.dtype
        elif self.dtype == "auto":
            dtype = current_platform.default_dtype(_checkpoint_dtype(self.hf_config))
        else:
            dtype = _DTYPE_NAMES[self.dtype]
        if dtype not in current_platform.supported_dtypes():
            raise ValueError(f"dtype={dtype} is not supported on {current_platform.device_type}")
        return dtype

    def _resolve_max_model_len(self) -> int:
        derived, key = hf_utils.derived_max_model_len(self.hf_text_config)
        window = self.get_sliding_window()
        if self.disable_sliding_window and window is not None:
            derived, key = min(derived, window), "sliding_window"
        if self.max_model_len is None:
            return derived
        assert isinstance(self.max_model_len, int)
        if self.max_model_len > derived and not envs.PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is greater than the maximum length of model "
                f"{self.model!r} ({derived}, from {key}); lower max_model_len or set "
                "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if you know the model handles longer contexts"
            )
        return self.max_model_len

    # -- architecture -----------------------------------------------------------------------------
    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def architecture(self) -> str | None:
        archs = self.architectures
        return archs[0] if archs else None

    @property
    def model_type(self) -> str:
        return str(getattr(self.hf_config, "model_type", ""))

    @property
    def runner_type(self) -> Literal["generate", "pooling"]:
        return "pooling" if self.pooler_config is not None else "generate"

    @property
    def is_moe(self) -> bool:
        text = self.hf_text_config
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0
        return int(experts) > 0

    @property
    def is_hybrid(self) -> bool:
        layer_types = getattr(self.hf_text_config, "layer_types", None) or []
        return any(t in ("mamba", "linear_attention", "conv") for t in layer_types)

    @property
    def is_multimodal_model(self) -> bool:
        return self.multimodal_config is not None

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(getattr(self.hf_config, "is_encoder_decoder", False))

    @property
    def is_diffusion(self) -> bool:
        return False

    @property
    def use_mla(self) -> bool:
        return getattr(self.hf_text_config, "kv_lora_rank", None) is not None

    @property
    def attention_chunk_size(self) -> int | None:
        return getattr(self.hf_text_config, "attention_chunk_size", None)

    @property
    def supports_replayssm(self) -> bool:
        return False

    def is_nvfp4_quantized(self) -> bool:
        return False

    def get_model_arch_config(self) -> ModelArchConfig:
        return ModelArchConfig(
            architectures=tuple(self.architectures),
            model_type=self.model_type,
            hidden_size=self.get_hidden_size(),
            num_hidden_layers=self.get_total_num_layers(),
            num_attention_heads=self.get_total_num_attention_heads(),
            num_key_value_heads=self.get_total_num_kv_heads(),
            head_dim=self.get_head_size(),
            vocab_size=self.get_vocab_size(),
        )

    def get_vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    def get_hidden_size(self) -> int:
        return int(self.hf_text_config.hidden_size)

    def get_head_size(self) -> int:
        head_dim = getattr(self.hf_text_config, "head_dim", None)
        if head_dim:
            return int(head_dim)
        return self.get_hidden_size() // self.get_total_num_attention_heads()

    def get_total_num_attention_heads(self) -> int:
        return int(self.hf_text_config.num_attention_heads)

    def get_total_num_kv_heads(self) -> int:
        kv = getattr(self.hf_text_config, "num_key_value_heads", None)
        return int(kv) if kv else self.get_total_num_attention_heads()

    def get_num_attention_heads(self, parallel_config: ParallelConfig) -> int:
        return max(1, self.get_total_num_attention_heads() // parallel_config.tensor_parallel_size)

    def get_num_kv_heads(self, parallel_config: ParallelConfig) -> int:
        # With more TP ranks than KV heads each rank keeps (a replica of) one KV head.
        return max(1, self.get_total_num_kv_heads() // parallel_config.tensor_parallel_size)

    def get_total_num_layers(self) -> int:
        return int(self.hf_text_config.num_hidden_layers)

    def get_layers_start_end_indices(
        self, parallel_config: ParallelConfig, pp_rank: int = 0
    ) -> tuple[int, int]:
        """The layer range of pipeline stage `pp_rank` (earlier stages take the remainder)."""
        total, stages = self.get_total_num_layers(), parallel_config.pipeline_parallel_size
        base, extra = divmod(total, stages)
        start = pp_rank * base + min(pp_rank, extra)
        return start, start + base + (1 if pp_rank < extra else 0)

    def get_num_layers(self, parallel_config: ParallelConfig, pp_rank: int = 0) -> int:
        start, end = self.get_layers_start_end_indices(parallel_config, pp_rank)
        return end - start

    def get_sliding_window(self) -> int | None:
        if not getattr(self.hf_text_config, "use_sliding_window", True):
            return None
        window = getattr(self.hf_text_config, "sliding_window", None)
        return int(window) if window else None

    # -- tokens and sampling defaults -------------------------------------------------------------
    def _generation_config_dict(self) -> dict[str, Any]:
        if self.generation_config == "vllm":
            return {}
        path = self.model_path if self.generation_config == "auto" else Path(self.generation_config)
        return hf_utils.read_generation_config(path)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Sampling defaults the model asks for (generation_config.json, then overrides)."""
        generation = {**self._generation_file, **self.override_generation_config}
        return {
            name: generation[key] for key, name in _GENERATION_KEYS.items() if generation.get(key) is not None
        }

    @property
    def bos_token_id(self) -> int | None:
        value = getattr(self.hf_text_config, "bos_token_id", None)
        return value[0] if isinstance(value, list) else value

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token id that ends generation: the config's eos plus generation_config's eos."""
        ids: list[int] = []
        for value in (
            getattr(self.hf_text_config, "eos_token_id", None),
            self._generation_file.get("eos_token_id"),
        ):
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and token not in ids:
                    ids.append(token)
        return ids

    @property
    def eos_token_id(self) -> int | None:
        ids = self.eos_token_ids
        return ids[0] if ids else None

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, read from the tokenizer (used for reasoning markers)."""
        from transformers import AutoTokenizer

        if self.gguf_file is not None:
            tok = AutoTokenizer.from_pretrained(self.gguf_file.parent, gguf_file=self.gguf_file.name)
        else:
            tok = AutoTokenizer.from_pretrained(self.tokenizer, trust_remote_code=self.trust_remote_code)
        return tok.get_vocab()

    # -- checks called by EngineConfig ------------------------------------------------------------
    def verify_with_parallel_config(self, parallel_config: ParallelConfig) -> None:
        tp = parallel_config.tensor_parallel_size
        heads = self.get_total_num_attention_heads()
        if heads % tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide the number of attention heads ({heads}) of {self.model!r}"
            )
        kv = self.get_total_num_kv_heads()
        if kv % tp and tp % kv:
            raise ValueError(
                f"tensor_parallel_size ({tp}) and the KV head count ({kv}) must divide one another"
            )
        pp, layers = parallel_config.pipeline_parallel_size, self.get_total_num_layers()
        if pp > layers:
            raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the number of layers ({layers})")

    def verify_dual_chunk_attention_config(self, load_config: LoadConfig) -> None:
        if getattr(self.hf_config, "dual_chunk_attention_config", None) is not None:
            raise ValueError(f"model {self.model!r} uses dual chunk attention, which is not supported")

    def maybe_untie_word_embeddings(self) -> None:
        """A checkpoint that ships its own lm_head while the config says tied is loaded untied."""
        if not getattr(self.hf_text_config, "tie_word_embeddings", False) or self.gguf_file is not None:
            return
        names = hf_utils.safetensors_weight_names(self.model_path)
        if names is not None and "lm_head.weight" in names:
            logger.info("%s: checkpoint has lm_head.weight; untying word embeddings", self.model)
            self.hf_text_config.tie_word_embeddings = False

    def compute_hash(self) -> str:
        # Everything that changes the traced forward: the architecture numbers (the whole HF config),
        # dtype, quantization, context length and the switches that alter attention.
        return hash_fields(
            self,
            (
                "model",
                "dtype",
                "quantization",
                "revision",
                "max_model_len",
                "max_logprobs",
                "logprobs_mode",
                "disable_sliding_window",
                "trust_remote_code",
                "hf_overrides",
            ),
            extra=[self.hf_config.to_json_string(use_diff=False)],
        )
