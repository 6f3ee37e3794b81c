"""LoadConfig: how weights are read."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

LoadFormat = Literal[
    "auto",
    "safetensors",
    "gguf",
    "dummy",
    "pt",
    "npcache",
    "sharded_state",
    "bitsandbytes",
    "runai_streamer",
    "runai_streamer_sharded",
    "modelexpress",
    "tensorizer",
]


@config
class LoadConfig:
    """Configuration of weight loading."""

    load_format: LoadFormat = "auto"
    """Weight format: "auto" picks GGUF for .gguf models and safetensors otherwise; "dummy" makes
    random weights without reading files (profiling, tests)."""
    download_dir: str | None = None
    """Directory to download and cache Hub models in (default: the Hugging Face cache)."""
    model_loader_extra_config: dict[str, Any] = Field(default_factory=dict)
    """Extra options for the weight loader: `gguf_dequantize` (true, the default: a GGUF file's
    weights are dequantized to the model dtype at load, the float path; false: they run from their
    blocks as stored); any other key is unsupported."""
    ignore_patterns: list[str] = Field(default_factory=lambda: ["original/**/*"])
    """File patterns to skip when downloading a Hub model's weights."""

    def compute_hash(self) -> str:
        # Where weights come from does not change the graph.
        return hash_fields(self, ())
