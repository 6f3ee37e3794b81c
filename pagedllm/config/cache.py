"""CacheConfig: the paged KV cache's layout and policy."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

CacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
MambaCacheMode = Literal["none", "all", "align"]


@config
class CacheConfig:
    """Configuration for the KV cache."""

    block_size: Annotated[int, Field(gt=0)] = 16
    """Size of a KV cache block in tokens; every sequence's cache is a list of such blocks."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Fraction of GPU memory the engine may use (weights, activations and KV cache), CUDA only."""
    kv_cache_memory_bytes: Annotated[int, Field(gt=0)] | None = None
    """KV cache size in bytes. Unset: on CPU a share of the memory left after loading the weights, on CUDA
    what `gpu_memory_utilization` leaves after a profiling run."""
    cache_dtype: CacheDType = "auto"
    """Data type of the KV cache; "auto" uses the model dtype. "fp8" (= "fp8_e4m3") and "fp8_e5m2" store
    keys and values in one byte each, divided by a per-layer scale (see `calculate_kv_scales`)."""
    calculate_kv_scales: bool = False
    """With an fp8 `cache_dtype`: compute each layer's key and value scales from the first prompt step
    (the largest magnitude of its keys / values over the fp8 maximum), then keep them. Unset, the
    scales are 1.0."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of identical prompt prefixes across requests."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = "sha256"
    """Hash of a KV block's identity (parent hash, token ids, extra keys): "sha256" hashes a pickle,
    "sha256_cbor" a canonical CBOR encoding (stable across languages), "xxhash*" are fast, non-crypto."""
    num_gpu_blocks_override: Annotated[int, Field(gt=0)] | None = None
    """Use exactly this many KV cache blocks instead of the profiled number (testing, preemption)."""
    num_gpu_blocks: int | None = None
    """Number of KV cache blocks, written by the worker after it sized the cache."""
    num_cpu_blocks: int | None = None
    """Number of CPU-side KV cache blocks, written by the worker (KV offloading)."""
    kv_offloading_size: Annotated[float, Field(gt=0)] | None = None
    """Size of the CPU KV offloading buffer in GiB; unset disables KV offloading."""
    kv_offloading_backend: Literal["native", "lmcache"] = "native"
    """Backend of KV offloading when `kv_offloading_size` is set."""
    kv_sharing_fast_prefill: bool = False
    """Skip prefill of layers whose KV cache is shared across layers (needs model support)."""
    mamba_block_size: Annotated[int, Field(gt=0)] | None = None
    """Block size of the Mamba state cache (hybrid models)."""
    mamba_cache_mode: MambaCacheMode = "none"
    """Prefix caching mode of Mamba state: "none", "all" or "align"."""
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Data type of the Mamba SSM state cache."""
    use_replayssm: bool = False
    """Replay SSM state updates for speculative decoding instead of caching every state."""
    use_kda_recoverssm: bool = False
    """RecoverSSM for KDA models; derived from `use_replayssm` and the architecture."""
    replayssm_buffer_len: Annotated[int, Field(gt=0)] = 8
    """Length of the ReplaySSM buffer in tokens."""

    def compute_hash(self) -> str:
        # Only the cache dtype and block size change what the compiled forward does with the cache.
        return hash_fields(self, ("cache_dtype", "block_size", "mamba_cache_mode", "mamba_ssm_cache_dtype"))
