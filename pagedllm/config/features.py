"""Smaller feature configs: reasoning, watermarking, Mamba kernels, diffusion LLMs, engram layers,
auxiliary outputs and RL weight transfer. Most of them pagedllm does not implement; their presence is
rejected by `pagedllm.config.support`, but they exist so the engine-wide rules can be stated."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

if TYPE_CHECKING:
    from pagedllm.config.model import ModelConfig
    from pagedllm.config.parallel import ParallelConfig


@config
class ReasoningConfig:
    """Configuration of reasoning-model output parsing."""

    reasoning_parser: str = ""
    """Name of the reasoning parser that splits chat responses into reasoning and content."""
    think_start_str: str = "<think>"
    """Text that opens the reasoning section."""
    think_end_str: str = "</think>"
    """Text that closes the reasoning section."""

    def __post_init__(self) -> None:
        self.think_start_token_id: int | None = None
        self.think_end_token_id: int | None = None
        if self.reasoning_parser:
            # Imported here: the parsers import the server's protocol, which the config must not load.
            from pagedllm.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser, "reasoning_config.reasoning_parser")

    def parser_markers_differ(self) -> list[str]:
        """The marker fields set to something else than the parser's own markers (which the parser
        uses: custom markers are not supported)."""
        if not self.reasoning_parser:
            return []
        from pagedllm.reasoning import get_reasoning_parser

        parser = get_reasoning_parser(self.reasoning_parser)
        return [
            name
            for name, marker in (("think_start_str", parser.start_token), ("think_end_str", parser.end_token))
            if getattr(self, name) != marker
        ]

    @property
    def enabled(self) -> bool:
        return self.think_start_token_id is not None and self.think_end_token_id is not None

    def initialize_token_ids(self, model_config: ModelConfig) -> None:
        """Look the start/end strings up in the model's vocabulary (single tokens only)."""
        vocab = model_config.get_vocab()
        self.think_start_token_id = vocab.get(self.think_start_str)
        self.think_end_token_id = vocab.get(self.think_end_str)

    def compute_hash(self) -> str:
        return hash_fields(self, ())


@config
class WatermarkConfig:
    """Configuration of output watermarking."""

    algorithm: Literal["gumbel", "dual_key_gumbel", "kgw"] = "gumbel"
    """Watermarking algorithm."""
    key: int = 0
    """Secret key of the watermark."""
    alpha: Annotated[float, Field(gt=0)] = 0.5
    """Mixing weight of the dual-key algorithm (unused under speculative decoding)."""
    allow_target_only_watermarking: bool = False
    """With speculative decoding, watermark only the target's tokens when the algorithm cannot cover
    draft tokens."""

    @property
    def supports_speculative_decoding(self) -> bool:
        return self.algorithm in ("gumbel", "dual_key_gumbel")

    @classmethod
    def default_alpha(cls) -> float:
        return cls.__dataclass_fields__["alpha"].default

    def compute_hash(self) -> str:
        return hash_fields(self, ())


@config
class MambaConfig:
    """Configuration of Mamba / SSM kernels."""

    backend: Literal["triton", "flashinfer"] = "triton"
    """Kernel backend of the SSM layers."""
    enable_stochastic_rounding: bool = False
    """Stochastic rounding of the SSM state (needs a float16 state cache)."""

    def compute_hash(self) -> str:
        return hash_fields(self, ("backend", "enable_stochastic_rounding"))


@config
class DiffusionConfig:
    """Configuration of diffusion LLM decoding."""

    canvas_length: Annotated[int, Field(ge=1)] | None = None
    """Tokens refined together per decoding step (the canvas)."""

    def compute_hash(self) -> str:
        return hash_fields(self, ("canvas_length",))


@config
class EngramConfig:
    """Configuration of engram (n-gram embedding) layers."""

    shared_memory: bool | None = None
    """Keep the n-gram tables in memory shared by data parallel ranks; unset: when DP > 1."""

    def verify_model_config(self, model_config: ModelConfig | None) -> None:
        if model_config is not None and not getattr(model_config.hf_text_config, "engram_layer_ids", None):
            raise ValueError(f"engram_config is set but model {model_config.model!r} has no engram layers")

    def resolve_dp_shared_memory(self, parallel_config: ParallelConfig) -> None:
        if self.shared_memory is None:
            self.shared_memory = parallel_config.data_parallel_size > 1

    def verify_parallel_config(self, parallel_config: ParallelConfig) -> None:
        if parallel_config.pipeline_parallel_size > 1:
            raise ValueError("engram layers do not support pipeline_parallel_size > 1")

    def compute_hash(self) -> str:
        return hash_fields(self, ())


@config
class AuxOutputConfig:
    """Configuration of auxiliary outputs returned with generated tokens."""

    return_routed_experts: bool = False
    """Return the MoE experts each token was routed to."""

    @property
    def enabled(self) -> bool:
        return self.return_routed_experts

    def compute_hash(self) -> str:
        return hash_fields(self, ("return_routed_experts",))


@config
class WeightTransferConfig:
    """Configuration of weight updates pushed by an RL trainer."""

    backend: Literal["nccl", "ipc"] = "nccl"
    """Transport of weight updates."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Backend options."""

    def compute_hash(self) -> str:
        return hash_fields(self, ())
