"""CompilationConfig: torch.compile, custom ops, fusion passes, CUDA graphs and compile ranges."""

from __future__ import annotations

import enum
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from pagedllm.config.utils import config, hash_all_fields_except

logger = logging.getLogger("pagedllm.config")


class CompilationMode(enum.IntEnum):
    """How the model forward is compiled."""

    NONE = 0
    """Eager PyTorch."""
    STOCK_TORCH_COMPILE = 1
    """Plain `torch.compile` of the forward."""
    DYNAMO_TRACE_ONCE = 2
    """Trace once with Dynamo, no guards afterwards."""
    VLLM_COMPILE = 3
    """pagedllm's compilation: Dynamo trace once, split at attention, Inductor per compile range."""


class CUDAGraphMode(enum.Enum):
    """Which batches replay captured CUDA graphs."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4

    def has_full_cudagraphs(self) -> bool:
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)

    def has_piecewise_cudagraphs(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)

    def requires_piecewise_compilation(self) -> bool:
        return self.has_piecewise_cudagraphs()

    def without_piecewise(self) -> CUDAGraphMode:
        """The mode with its piecewise part dropped: mixed batches then run eagerly."""
        if self == CUDAGraphMode.PIECEWISE:
            return CUDAGraphMode.NONE
        if self == CUDAGraphMode.FULL_AND_PIECEWISE:
            return CUDAGraphMode.FULL_DECODE_ONLY
        return self


def _parse_enum(enum_cls: type[enum.Enum], value: Any) -> Any:
    """Accept the enum, its name (any case) or its integer value (CLI and JSON inputs)."""
    if value is None or isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        if value.isdigit():
            return enum_cls(int(value))
        try:
            return enum_cls[value.upper()]
        except KeyError:
            names = ", ".join(m.name for m in enum_cls)
            raise ValueError(f"unknown {enum_cls.__name__} {value!r}; expected one of {names}") from None
    return enum_cls(value)


# Ops the compiled graph is split at for piecewise CUDA graphs: attention reads and writes the paged
# KV cache through the block table, which cannot be captured for every batch shape.
ATTENTION_SPLITTING_OPS = ["pagedllm.unified_attention", "pagedllm.kv_cache_update"]
KV_CACHE_UPDATE_OP = "pagedllm.kv_cache_update"

# All-reduce + RMSNorm fusion payload limit in MiB by (capability family, TP size), as tuned upstream.
_FI_ALLREDUCE_FUSION_MAX_MB: dict[int, dict[int, float]] = {
    90: {2: 64, 4: 2, 8: 1},
    100: {2: 64, 4: 32, 8: 1},
}


@config
class PassConfig:
    """Graph fusion passes; unset fields are filled by the optimization level."""

    fuse_norm_quant: bool | None = None
    """Fuse RMSNorm with the following quantization."""
    fuse_act_quant: bool | None = None
    """Fuse SiLU-and-mul with the following quantization."""
    fuse_allreduce_rms: bool | None = None
    """Fuse the tensor parallel all-reduce with the following RMSNorm."""
    fuse_attn_quant: bool | None = None
    """Fuse attention output quantization into attention."""
    enable_sp: bool | None = None
    """Sequence parallelism between tensor parallel ranks."""
    fuse_gemm_comms: bool | None = None
    """Overlap GEMMs with collectives (async TP)."""
    fuse_act_padding: bool | None = None
    """Fuse activation padding into the fused add-RMSNorm."""
    fuse_mla_dual_rms_norm: bool | None = None
    """Fuse the two RMSNorms of MLA attention."""
    fuse_rope_kvcache: bool | None = None
    """Fuse RoPE with the KV cache write."""
    fuse_qk_norm_rope_kvcache: bool | None = None
    """Fuse q/k norm, RoPE and the KV cache write."""
    enable_qk_norm_rope_fusion: bool | None = None
    """Fuse q/k norm with RoPE."""
    fuse_rope_kvcache_cat_mla: bool | None = None
    """Fuse RoPE, KV cache write and concat for MLA."""
    rope_kvcache_fusion_max_token_num: int | None = 256
    """Token count up to which the RoPE + KV cache fusions apply."""
    fi_allreduce_fusion_max_size_mb: dict[int, float] | None = None
    """Per TP size, the largest all-reduce payload (MiB) of the fused all-reduce + RMSNorm."""

    def flashinfer_max_size(self, world_size: int) -> int | None:
        """Largest all-reduce payload in bytes for the fused path at this TP size, None if unknown."""
        from pagedllm.platforms import current_platform

        table = self.fi_allreduce_fusion_max_size_mb
        if table is None:
            cap = current_platform.get_device_capability()
            family = cap.to_int() // 10 * 10 if cap is not None else None
            table = _FI_ALLREDUCE_FUSION_MAX_MB.get(family, {}) if family is not None else {}
        mb = table.get(world_size)
        return None if mb is None else int(mb * 2**20)

    def enabled_passes(self) -> list[str]:
        return [
            name
            for name in self.__dataclass_fields__
            if name.startswith(("fuse_", "enable_")) and getattr(self, name)
        ]

    def log_enabled_passes(self) -> None:
        logger.debug("enabled compilation passes: %s", ", ".join(self.enabled_passes()) or "none")

    def compute_hash(self) -> str:
        return hash_all_fields_except(self, ())


@config
class CompilationConfig:
    """Configuration of compilation and CUDA graphs."""

    mode: CompilationMode | None = None
    """Compilation mode (0 none, 1 torch.compile, 2 trace once, 3 pagedllm compile); unset: from the
    optimization level."""
    backend: str = ""
    """torch.compile backend ("inductor", "eager", ...); empty: the platform default."""
    custom_ops: list[str] = Field(default_factory=list)
    """Custom op switches: "all"/"none" as the base, then "+name"/"-name" per op."""
    splitting_ops: list[str] | None = None
    """Ops the graph is split at for piecewise compilation; unset: attention ops."""
    use_inductor_graph_partition: bool | None = None
    """Let Inductor partition the graph instead of splitting it before compilation."""
    compile_sizes: list[int] | None = None
    """Batch sizes compiled for specifically (beyond the dynamic-shape ranges)."""
    compile_ranges_endpoints: list[int] | None = None
    """Extra split points of the token-count ranges compiled separately; the final list is computed."""
    inductor_compile_config: dict[str, Any] = Field(default_factory=dict)
    """Extra Inductor options."""
    cudagraph_mode: CUDAGraphMode | None = None
    """CUDA graph mode (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE); unset: from the
    optimization level."""
    cudagraph_capture_sizes: list[int] | None = None
    """Batch sizes (tokens) to capture CUDA graphs for; unset: derived from max_num_seqs."""
    max_cudagraph_capture_size: int | None = None
    """Largest CUDA graph capture size; unset: derived."""
    cudagraph_num_of_warmups: int = 0
    """Eager warm-up runs before capturing a graph."""
    cudagraph_mm_encoder: bool = False
    """Capture CUDA graphs for the multimodal encoder."""
    compile_mm_encoder: bool = False
    """Compile the multimodal encoder."""
    pass_config: PassConfig = Field(default_factory=PassConfig)
    """Fusion passes."""
    ir_enable_torch_wrap: bool | None = None
    """Wrap IR ops so Inductor can see through them; unset: on with pagedllm compile and Inductor."""
    fast_moe_cold_start: bool | None = None
    """Faster MoE compilation on cold start."""
    debug_dump_path: Path | None = None
    """Directory to dump compiled graphs into (PAGEDLLM_DEBUG_DUMP_PATH overrides it)."""
    cache_dir: str = ""
    """Directory of the on-disk compilation cache; empty: under ~/.cache/pagedllm."""

    @field_validator("mode", mode="before")
    @classmethod
    def _parse_mode(cls, value: Any) -> Any:
        return _parse_enum(CompilationMode, value)

    @field_validator("cudagraph_mode", mode="before")
    @classmethod
    def _parse_cudagraph_mode(cls, value: Any) -> Any:
        return _parse_enum(CUDAGraphMode, value)

    def __post_init__(self) -> None:
        # Filled by model construction: layer name -> layer object (attention layers bind their KV cache).
        self.static_forward_context: dict[str, Any] = {}
        # Batch size -> captured size it is padded to; filled by post_init_cudagraph_sizes().
        self.bs_to_padded_graph_size: list[int] = []
        # Custom ops that layers reported as enabled / disabled while being built.
        self.enabled_custom_ops: Counter[str] = Counter()
        self.disabled_custom_ops: Counter[str] = Counter()

    def is_custom_op_enabled(self, name: str) -> bool:
        """`+name`/`-name` win; otherwise the base: "all" enables every op, "none" none."""
        if f"+{name}" in self.custom_ops:
            return True
        if f"-{name}" in self.custom_ops:
            return False
        return "all" in self.custom_ops

    def splitting_ops_contain_kv_cache_update(self) -> bool:
        return self.splitting_ops is not None and KV_CACHE_UPDATE_OP in self.splitting_ops

    def set_splitting_ops_for_v1(self, all2all_backend: str, data_parallel_size: int = 1) -> None:
        """Default splitting ops: attention when piecewise graphs need a split graph, else none.

        `all2all_backend` and `data_parallel_size` matter upstream for MoE expert-parallel splitting;
        pagedllm runs dense models only, so they do not change the result."""
        if self.splitting_ops is not None:
            return
        graph_mode = self.cudagraph_mode or CUDAGraphMode.NONE
        if self.mode == CompilationMode.VLLM_COMPILE and not self.use_inductor_graph_partition:
            self.splitting_ops = (
                list(ATTENTION_SPLITTING_OPS) if graph_mode.has_piecewise_cudagraphs() else []
            )
        else:
            self.splitting_ops = []

    def post_init_cudagraph_sizes(self) -> None:
        """Build the batch-size -> padded-graph-size table from the final capture sizes."""
        sizes = self.cudagraph_capture_sizes or []
        table: list[int] = []
        if sizes:
            idx = 0
            for bs in range(sizes[-1] + 1):
                while sizes[idx] < bs:
                    idx += 1
                table.append(sizes[idx])
        self.bs_to_padded_graph_size = table

    def padded_graph_size(self, num_tokens: int) -> int | None:
        """The captured size a batch of `num_tokens` replays at, None when it runs without graphs."""
        if num_tokens < len(self.bs_to_padded_graph_size):
            return self.bs_to_padded_graph_size[num_tokens]
        return None

    def custom_op_log_check(self) -> None:
        """Warn about "+op"/"-op" switches naming ops that no layer used."""
        seen = set(self.enabled_custom_ops) | set(self.disabled_custom_ops)
        for entry in self.custom_ops:
            if entry[:1] in "+-" and entry[1:] not in seen:
                logger.warning(
                    "custom op %r from custom_ops=%s was not used by the model", entry[1:], self.custom_ops
                )

    def compute_hash(self) -> str:
        # Paths and warm-up counts do not change what is compiled.
        return hash_all_fields_except(self, ("debug_dump_path", "cache_dir", "cudagraph_num_of_warmups"))
