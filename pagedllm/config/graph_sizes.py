"""The exact sizing algorithms: CUDA-graph capture sizes, compile ranges and the scheduled-token
budget under speculative decoding (spec sections 5.1-5.3)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.config.compilation import CUDAGraphMode
from pagedllm.config.utils import warning_once

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")


def _grid(max_size: int, interactivity: bool) -> list[int]:
    """Default capture grid: 1,2,4 (or 1..32), then step 8 below 256, then step 16 up to max_size."""
    if interactivity:
        sizes = list(range(1, min(max_size, 32) + 1))
    else:
        sizes = [x for x in (1, 2, 4) if x <= max_size]
    if max_size >= 8:
        sizes += range(8, min(max_size + 1, 256), 8)
    if max_size >= 256:
        sizes += range(256, max_size + 1, 16)
    return sizes


def _request_counts(m: int, ceiling: int) -> list[int]:
    m = min(m, ceiling)
    counts = {x for x in (1, 2, 4) if x <= m}
    counts.update(range(8, min(m + 1, 256), 8))
    counts.update(range(256, m + 1, 16))
    counts.add(m)
    return sorted(counts)


def _decode_tiers(cfg: EngineConfig, q: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(query length, widest batch using it) pairs; several tiers under dynamic speculative decoding."""
    spec = cfg.speculative_config
    tiers = [(q, max_num_seqs)]
    if spec is None or not spec.uses_dynamic_speculative_decoding():
        return tiers
    try:
        lengths = spec.dense_draft_lengths(max_num_seqs)
    except ValueError:
        return tiers
    widest: dict[int, int] = {}
    for batch_size in range(1, len(lengths)):
        widest[lengths[batch_size] + 1] = batch_size
    return list(widest.items())


def set_cudagraph_sizes(cfg: EngineConfig) -> None:
    """Spec 5.1: the sorted capture sizes and their maximum."""
    from pagedllm.platforms import current_platform

    cc = cfg.compilation_config
    sc = cfg.scheduler_config
    mc = cfg.model_config
    if mc is None or mc.enforce_eager or cc.cudagraph_mode == CUDAGraphMode.NONE:
        cc.max_cudagraph_capture_size = 0
        cc.cudagraph_capture_sizes = []
        cc.post_init_cudagraph_sizes()
        return
    assert sc.max_num_seqs is not None and sc.max_num_batched_tokens is not None
    seqs, tokens = sc.max_num_seqs, sc.max_num_batched_tokens
    user_max = cc.max_cudagraph_capture_size
    user_sizes = cc.cudagraph_capture_sizes
    q = cfg.uniform_decode_query_len
    max_size = user_max
    decode_sizes: list[int] = []
    if user_max is None:
        ceiling = 1024 if current_platform.is_device_capability_family(100) else 512
        max_size = min(seqs * q * 2, ceiling)
        if q > 1:
            found = {
                n * ql
                for ql, widest in _decode_tiers(cfg, q, seqs)
                for n in _request_counts(widest, ceiling)
                if n * ql <= max_size
            }
            decode_sizes = sorted(found)
        elif seqs <= max_size:
            decode_sizes = [seqs]
    assert max_size is not None
    max_size = min(tokens, max_size)
    assert max_size >= 1, "max_cudagraph_capture_size must be >= 1 when CUDA graphs are used"

    if user_sizes is not None:
        assert len(user_sizes) > 0, "cudagraph_capture_sizes must not be empty when CUDA graphs are used"
        result = sorted({s for s in user_sizes if s <= tokens})
    else:
        sizes = set(_grid(max_size, cfg.performance_mode == "interactivity"))
        if tokens <= max_size:
            sizes.add(tokens)
        sizes.update(s for s in decode_sizes if s <= tokens)
        result = sorted(sizes)

    valid_max = result[-1] if result else 0
    if user_max is not None and user_max != valid_max:
        if user_sizes is not None:
            raise ValueError(
                f"compilation_config.max_cudagraph_capture_size ({user_max}) must equal the largest of "
                f"compilation_config.cudagraph_capture_sizes ({valid_max}) after dropping sizes above "
                f"max_num_batched_tokens ({tokens})"
            )
        logger.warning("Truncating max_cudagraph_capture_size to %d", valid_max)
    cc.max_cudagraph_capture_size = valid_max
    if user_sizes is not None and len(result) < len(user_sizes):
        logger.warning(
            "cudagraph_capture_sizes %s was overridden to %s (duplicates and sizes above "
            "max_num_batched_tokens=%d removed)",
            user_sizes,
            result,
            tokens,
        )
    cc.cudagraph_capture_sizes = result
    cc.post_init_cudagraph_sizes()


def set_compile_ranges(cfg: EngineConfig) -> None:
    """Spec 5.2: split points of the token-count ranges compiled separately."""
    import torch

    cc = cfg.compilation_config
    pc = cc.pass_config
    mc = cfg.model_config
    end = cfg.scheduler_config.max_num_batched_tokens
    points: list[int] = [end] if end is not None else []
    if pc.fuse_allreduce_rms:
        max_bytes = pc.flashinfer_max_size(cfg.parallel_config.tensor_parallel_size)
        if max_bytes is not None and mc is not None:
            assert isinstance(mc.dtype, torch.dtype)
            n = max_bytes // (mc.get_hidden_size() * mc.dtype.itemsize)
            if end is not None and n < end:
                points.append(n)
            else:
                logger.debug("all-reduce fusion limit %d tokens is not below the budget", n)
    for enabled in (pc.fuse_rope_kvcache, pc.fuse_qk_norm_rope_kvcache):
        n = pc.rope_kvcache_fusion_max_token_num
        if enabled and n is not None and end is not None and n < end:
            points.append(n)
    for x in cc.compile_ranges_endpoints or []:
        assert isinstance(x, int), f"compile range endpoint {x!r} must be an int"
        assert x > 0, f"Invalid compile range endpoint {x}: endpoints must be > 0"
        if end is not None and 1 < x < end:
            points.append(x)
    cc.compile_ranges_endpoints = sorted(points)


def set_max_num_scheduled_tokens(cfg: EngineConfig) -> None:
    """Spec 5.3: the scheduled-token budget when speculative decoding is on."""
    spec = cfg.speculative_config
    sc = cfg.scheduler_config
    if spec is None:
        return
    delta = spec.max_num_new_slots_for_drafting
    tokens = sc.max_num_batched_tokens
    assert tokens is not None
    if sc.max_num_scheduled_tokens is None:
        sc.max_num_scheduled_tokens = tokens
    if sc.max_num_scheduled_tokens <= 0:
        raise ValueError(
            f"max_num_scheduled_tokens ({sc.max_num_scheduled_tokens}) leaves no token to schedule; increase "
            "max_num_batched_tokens or decrease num_speculative_tokens"
        )
    if sc.max_num_scheduled_tokens < 8192:
        warning_once(
            f"max_num_scheduled_tokens={sc.max_num_scheduled_tokens} with speculative decoding may be suboptimal"
        )
    if tokens <= delta:
        raise ValueError(
            f"max_num_batched_tokens ({tokens}) must be larger than the drafting slots per request ({delta}) "
            "to schedule a token plus its drafts"
        )
