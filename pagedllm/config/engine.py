"""EngineConfig: every sub-config of the engine, validated against each other at construction.

Construction (`__post_init__`) runs the procedure of the configuration spec (steps P01-P72, see
`pagedllm/config/construction.py`), then `pagedllm.config.support.check_supported` rejects any feature
the engine does not implement, then the after-validators run. After that, components only read it.
"""

from __future__ import annotations

import copy
import enum
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from pagedllm import envs
from pagedllm.config.attention import AttentionConfig
from pagedllm.config.cache import CacheConfig
from pagedllm.config.compilation import CompilationConfig, CUDAGraphMode
from pagedllm.config.device import DeviceConfig
from pagedllm.config.features import (
    AuxOutputConfig,
    DiffusionConfig,
    EngramConfig,
    MambaConfig,
    ReasoningConfig,
    WatermarkConfig,
    WeightTransferConfig,
)
from pagedllm.config.kernel import KernelConfig
from pagedllm.config.kv_transfer import (
    ECTransferConfig,
    EncoderCacheManagerConfig,
    KVEventsConfig,
    KVTransferConfig,
)
from pagedllm.config.load import LoadConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.model import ModelConfig
from pagedllm.config.observability import LoggingConfig, ObservabilityConfig, ProfilerConfig
from pagedllm.config.offload import OffloadConfig
from pagedllm.config.parallel import ParallelConfig
from pagedllm.config.scheduler import SchedulerConfig
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.config.structured_outputs import StructuredOutputsConfig
from pagedllm.config.utils import config
from pagedllm.quant_interface import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PerformanceMode = Literal["balanced", "interactivity", "throughput"]


class OptimizationLevel(enum.IntEnum):
    """Start-up time versus steady-state speed."""

    O0 = 0
    """No optimization: no compilation, no CUDA graphs; fastest start-up."""
    O1 = 1
    """Quick optimizations: torch.compile (Dynamo + Inductor) and piecewise CUDA graphs."""
    O2 = 2
    """Full optimizations: O1 plus full and piecewise CUDA graphs (the default)."""
    O3 = 3
    """Currently the same as O2."""


@config
class EngineConfig:
    """The whole engine configuration."""

    model_config: ModelConfig | None = None
    """Model (no default instance: building one resolves a model)."""
    cache_config: CacheConfig = Field(default_factory=CacheConfig)
    """KV cache."""
    parallel_config: ParallelConfig = Field(default_factory=ParallelConfig)
    """Distributed execution."""
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Scheduler."""
    device_config: DeviceConfig = Field(default_factory=DeviceConfig)
    """Device."""
    load_config: LoadConfig = Field(default_factory=LoadConfig)
    """Weight loading."""
    offload_config: OffloadConfig = Field(default_factory=OffloadConfig)
    """Weight offloading."""
    attention_config: AttentionConfig = Field(default_factory=AttentionConfig)
    """Attention."""
    aux_output_config: AuxOutputConfig = Field(default_factory=AuxOutputConfig)
    """Auxiliary outputs."""
    engram_config: EngramConfig | None = None
    """Engram layers."""
    mamba_config: MambaConfig = Field(default_factory=MambaConfig)
    """Mamba kernels."""
    kernel_config: KernelConfig = Field(default_factory=KernelConfig)
    """Kernel selection."""
    lora_config: LoRAConfig | None = None
    """LoRA adapters."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding."""
    watermark_config: WatermarkConfig | None = None
    """Output watermarking."""
    diffusion_config: DiffusionConfig | None = None
    """Diffusion LLM decoding."""
    structured_outputs_config: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    """Structured outputs."""
    observability_config: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    """Metrics and tracing."""
    logging_config: LoggingConfig = Field(default_factory=LoggingConfig)
    """Logging."""
    quant_config: QuantizationConfig | None = None
    """Quantization method object overriding the one the loader resolves from `model_config.quantization`."""
    compilation_config: CompilationConfig = Field(default_factory=CompilationConfig)
    """Compilation and CUDA graphs."""
    profiler_config: ProfilerConfig = Field(default_factory=ProfilerConfig)
    """Profiler."""
    kv_transfer_config: KVTransferConfig | None = None
    """KV connector (disaggregated prefill, KV offloading)."""
    kv_events_config: KVEventsConfig | None = None
    """KV cache events."""
    ec_transfer_config: ECTransferConfig | None = None
    """Encoder-cache transfer."""
    ec_manager_config: EncoderCacheManagerConfig = Field(default_factory=EncoderCacheManagerConfig)
    """Encoder-cache manager."""
    reasoning_config: ReasoningConfig | None = None
    """Reasoning-model token ids."""
    additional_config: dict[str, Any] | Any = Field(default_factory=dict)
    """Opaque extras for platform plug-ins; part of the hash (a dict, or an object with compute_hash())."""
    instance_id: str = ""
    """Identity of this engine instance (always set at construction to the current time in ns)."""
    optimization_level: OptimizationLevel = OptimizationLevel.O2
    """Optimization level: O0 eager, O1 compiled, O2/O3 compiled plus CUDA graphs."""
    performance_mode: PerformanceMode = "balanced"
    """Runtime bias: "interactivity" captures every small batch size, "throughput" favours big batches."""
    weight_transfer_config: WeightTransferConfig | None = None
    """RL weight transfer."""
    shutdown_timeout: int = Field(default=0, ge=0)
    """Seconds shutdown waits for running requests before aborting them (0: none)."""

    def __post_init__(self) -> None:
        from pagedllm.config.construction import construct
        from pagedllm.config.support import check_supported, unsupported_error

        try:
            construct(self)
        except (ValueError, AssertionError) as e:
            error = unsupported_error(self, e)
            if error is not None:
                raise error from e
            raise
        if not (self.model_config is not None and self.model_config.is_submodel_config):
            check_supported(self)

    # -- derived properties (components read these instead of re-deriving) ------------------------
    @property
    def is_mm_encoder_only(self) -> bool:
        mc = self.model_config
        return bool(mc is not None and mc.multimodal_config and mc.multimodal_config.get("mm_encoder_only"))

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative_config
        if spec is not None and spec.num_speculative_tokens is not None:
            return spec.num_speculative_tokens
        if self.diffusion_config is not None and self.diffusion_config.canvas_length is not None:
            return self.diffusion_config.canvas_length
        return 0

    @property
    def uniform_decode_query_len(self) -> int:
        """Query tokens per request in a uniform decode batch (1 + draft tokens)."""
        return 1 + self.num_speculative_tokens

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots to reserve per request beyond the scheduled target tokens."""
        spec = self.speculative_config
        if spec is None:
            return 0
        k = self.num_speculative_tokens
        if spec.use_dflash():
            return k + 1
        if spec.use_dspark():
            draft_hf = getattr(spec.draft_model_config, "hf_config", None)
            if not getattr(draft_hf, "sample_from_anchor", True):
                return k + 1
        if spec.use_eagle() or spec.uses_draft_model():
            return k
        return 0

    @property
    def num_prefill_lookahead_tokens(self) -> int:
        """Prompt tokens past the computed range the drafter reads mid-prefill."""
        spec = self.speculative_config
        if spec is None or not spec.use_eagle():
            return 0
        return self.num_speculative_tokens if spec.use_multi_module_mtp() else 1

    @property
    def max_concurrent_batches(self) -> int:
        pp = self.parallel_config.pipeline_parallel_size
        if self.scheduler_config.async_scheduling:
            if self.use_v2_model_runner:
                return pp + 1
            if pp <= 1:
                return 2
        return pp

    @property
    def max_in_flight_tokens(self) -> int:
        tokens = self.scheduler_config.max_num_batched_tokens
        assert tokens is not None
        return self.max_concurrent_batches * tokens

    @property
    def needs_dp_coordinator(self) -> bool:
        pc = self.parallel_config
        mc = self.model_config
        return pc.data_parallel_size > 1 and (mc is None or mc.is_moe or not pc.data_parallel_external_lb)

    @property
    def use_cumem_cudagraph_pool(self) -> bool:
        from pagedllm.platforms import current_platform

        mc = self.model_config
        return bool(
            mc is not None
            and mc.sleep_mode_offload_cudagraph
            and mc.enable_sleep_mode
            and mc.sleep_mode_backend == "cumem"
            and self.compilation_config.cudagraph_mode not in (None, CUDAGraphMode.NONE)
            and current_platform.is_cuda()
        )

    @property
    def use_v2_model_runner(self) -> bool:
        from pagedllm.config.runner_select import select_v2_model_runner

        return select_v2_model_runner(self)

    # -- public methods -----------------------------------------------------------------------------
    def compute_hash(self, include_version: bool = True) -> str:
        """10 hex characters identifying everything that affects the compiled graph."""
        from pagedllm.config.hashing import engine_config_hash

        return engine_config_hash(self, include_version)

    def with_hf_config(
        self, hf_config: PretrainedConfig, architectures: list[str] | None = None
    ) -> EngineConfig:
        """A copy of this config for a sub-model (e.g. a draft model) described by `hf_config`."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        assert self.model_config is not None
        if architectures is not None:
            hf_config = copy.deepcopy(hf_config)
            hf_config.architectures = architectures
        elif getattr(hf_config, "architectures", None) is None:
            causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
            if causal is not None:
                hf_config = copy.deepcopy(hf_config)
                hf_config.architectures = [causal]
        model_config = copy.deepcopy(self.model_config)
        if model_config.is_multimodal_model and hasattr(self.model_config.hf_config, "tie_word_embeddings"):
            hf_config.get_text_config().tie_word_embeddings = self.model_config.hf_config.tie_word_embeddings
        model_config.hf_config = hf_config
        model_config.hf_text_config = hf_config.get_text_config()
        model_config.model_arch_config = model_config.get_model_arch_config()
        model_config.is_submodel_config = True
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        fields["model_config"] = model_config
        return type(self)(**fields)

    def compile_debug_dump_path(self) -> Path | None:
        path = self.compilation_config.debug_dump_path
        if path is None:
            return None
        pc = self.parallel_config
        return path / f"rank_{pc.rank}_dp_{pc.data_parallel_index}"

    def enable_trace_function_call_for_thread(self) -> None:
        """With PAGEDLLM_TRACE_FUNCTION set, log every Python call of this thread to a file."""
        if not envs.PAGEDLLM_TRACE_FUNCTION:
            return
        user = envs.USER or envs.USERNAME or "user"
        name = (
            f"PAGEDLLM_TRACE_FUNCTION_for_process_{os.getpid()}_thread_{threading.get_ident()}_at_"
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}.log"
        ).replace(" ", "_")
        path = (
            Path(tempfile.gettempdir()) / user / "pagedllm" / f"pagedllm-instance-{self.instance_id}" / name
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        _enable_trace_function_call(path)

    def validate_block_size(self) -> None:
        """Checks that need the final block size (called after the platform/worker fixed it)."""
        from pagedllm.config.seed.checks import validate_block_size

        validate_block_size(self)

    def adjust_dcp_kv_cache_interleave_size(self, kv_cache_config: Any) -> None:
        from pagedllm.config.seed.checks import adjust_dcp_kv_cache_interleave_size

        adjust_dcp_kv_cache_interleave_size(self, kv_cache_config)

    def try_verify_and_update_config(self) -> None:
        from pagedllm.config.construction import try_verify_and_update_config

        try_verify_and_update_config(self)

    # -- after-validators (run after __post_init__, also for sub-model views) ----------------------
    @model_validator(mode="after")
    def validate_nvfp4_kv_cache_with_mla(self) -> EngineConfig:
        from pagedllm.config.seed.checks import validate_nvfp4_kv_cache_with_mla

        validate_nvfp4_kv_cache_with_mla(self)
        return self

    @model_validator(mode="after")
    def validate_mamba_block_size(self) -> EngineConfig:
        from pagedllm.config.seed.checks import validate_mamba_block_size

        validate_mamba_block_size(self)
        return self

    @model_validator(mode="after")
    def validate_mamba_cached_kernel(self) -> EngineConfig:
        from pagedllm.config.seed.checks import validate_replayssm

        validate_replayssm(self)
        return self

    def __str__(self) -> str:
        from pagedllm.config.hashing import engine_config_str

        return engine_config_str(self)


def _enable_trace_function_call(path: Path) -> None:
    """Write one line per Python function call of the current thread to `path`."""
    log = open(path, "a", buffering=1)  # stays open while the thread traces

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            log.write(f"{time.time():.6f} call {code.co_filename}:{frame.f_lineno} {code.co_name}\n")
        return None

    sys.settrace(tracer)
