"""pagedllm's configuration: one pydantic dataclass per sub-config, aggregated by EngineConfig."""

from pagedllm.config.attention import AttentionConfig
from pagedllm.config.cache import CacheConfig
from pagedllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode, PassConfig
from pagedllm.config.current import (
    get_cached_compilation_config,
    get_current_config,
    get_layers_from_config,
    set_current_config,
)
from pagedllm.config.device import DeviceConfig
from pagedllm.config.engine import EngineConfig, OptimizationLevel
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
from pagedllm.config.optimization import (
    OPTIMIZATION_LEVEL_TO_CONFIG,
    enable_act_fusion,
    enable_allreduce_rms_fusion,
    enable_mla_dual_rms_norm_fusion,
    enable_norm_fusion,
    enable_norm_pad_fusion,
    enable_qk_norm_rope_kvcache,
    enable_rope_kvcache_fusion,
    enable_rope_kvcache_mla_fusion,
)
from pagedllm.config.parallel import ParallelConfig
from pagedllm.config.scheduler import SchedulerConfig
from pagedllm.config.speculative import SpeculativeConfig
from pagedllm.config.structured_outputs import StructuredOutputsConfig
from pagedllm.quant_interface import QuantizationConfig


def default_breakable_cudagraph_architectures() -> frozenset[str]:
    """Architectures captured with breakable CUDA graphs by default on the current platform."""
    from pagedllm.platforms import current_platform

    return current_platform.default_breakable_cudagraph_architectures()


__all__ = [
    "OPTIMIZATION_LEVEL_TO_CONFIG",
    "AttentionConfig",
    "AuxOutputConfig",
    "CacheConfig",
    "CompilationConfig",
    "CompilationMode",
    "CUDAGraphMode",
    "DeviceConfig",
    "DiffusionConfig",
    "ECTransferConfig",
    "EncoderCacheManagerConfig",
    "EngineConfig",
    "EngramConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "KernelConfig",
    "LoRAConfig",
    "LoadConfig",
    "LoggingConfig",
    "MambaConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "OffloadConfig",
    "OptimizationLevel",
    "ParallelConfig",
    "PassConfig",
    "ProfilerConfig",
    "QuantizationConfig",
    "ReasoningConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "WatermarkConfig",
    "WeightTransferConfig",
    "default_breakable_cudagraph_architectures",
    "enable_act_fusion",
    "enable_allreduce_rms_fusion",
    "enable_mla_dual_rms_norm_fusion",
    "enable_norm_fusion",
    "enable_norm_pad_fusion",
    "enable_qk_norm_rope_kvcache",
    "enable_rope_kvcache_fusion",
    "enable_rope_kvcache_mla_fusion",
    "get_cached_compilation_config",
    "get_current_config",
    "get_layers_from_config",
    "set_current_config",
]
