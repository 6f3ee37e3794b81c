"""The single gate between what the configuration can express and what pagedllm implements.

Why a gate: the configuration follows the upstream spec, which describes many features pagedllm does
not have (context parallelism, DBO, engram, diffusion, ...).
Their sub-configs and rules exist so that the spec's algorithms (CUDA-graph capture sizes with
speculative decode, lookahead slots, KV offloading -> connector derivation) are computed exactly and can be tested. But a user enabling one must get a clear
error, never a silently ignored flag. So `EngineConfig.__post_init__` runs the whole construction and
then calls `check_supported`, which lists every enabled feature outside `SUPPORTED` and raises one
ValueError naming each flag.

`allow_unsupported()` lifts the gate inside a `with` block. It exists for the algorithm tests and for
planning tools (e.g. printing the graph sizes a speculative config would get); the engine itself calls
`check_supported` again when it starts, so a config built under the lifted gate can never run.
When a feature gets implemented, delete its entry from its group in `_checks` and say so in SUPPORTED.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pagedllm.config.compilation import CompilationMode
from pagedllm.config.kv_transfer import KV_CONNECTORS
from pagedllm.config.speculative import IMPLEMENTED_METHODS

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

# What the engine implements, for the error message and the docs.
SUPPORTED = (
    "dense decoder models (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, Granite) "
    "from HF safetensors directories or GGUF files (Phi-3 GGUF without LongRoPE factors; dequantized at "
    "load, or with model_loader_extra_config gguf_dequantize=false the linear layers and the embedding / "
    "LM head of Llama-family models run from the Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K-Q6_K blocks); "
    "4-bit AWQ (GEMM layout) and GPTQ (v1 format, with or without act-order) checkpoints, detected from "
    "config.json's quantization_config, their linear layers run from the packed weights; online fp8 "
    "(quantization='fp8': an unquantized checkpoint's linear layers stored as e4m3 with per-channel "
    "scales) and fp8 checkpoints (e4m3 weights with per-tensor or per-channel weight_scale, detected from "
    "config.json; not block-wise weight_block_size scales, not compressed-tensors); "
    "mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral; no expert parallelism); "
    "pooling models (BertModel / BertForSequenceClassification encoders, and the Llama, Qwen2 and Qwen3 "
    "decoders as last-token embedders); dtypes float32/bfloat16/float16; paged KV cache with prefix caching (cache_dtype auto/float32/bfloat16/float16, or fp8/fp8_e4m3/fp8_e5m2 with per-layer scales, 1.0 or calculate_kv_scales); chunked prefill; fcfs and "
    "priority scheduling; tensor and pipeline parallelism (distributed_executor_backend 'mp', 'ray' or 'external_launcher'); "
    "data parallelism under `pagedllm serve` (data_parallel_size engine cores behind one server, or one rank "
    "per server with data_parallel_external_lb and data_parallel_rank); torch.compile levels O0-O3 "
    "(without CUDA graphs: on CUDA the compiled forward runs uncaptured, with a warning); "
    "load formats auto/safetensors/gguf/dummy; reasoning parsers (reasoning_config.reasoning_parser, "
    "structured_outputs_config.reasoning_parser); sleep mode (levels 1 and 2); weight updates from an RL "
    "trainer (weight_transfer_config backend 'nccl': NCCL on CUDA, gloo on the CPU; backend 'ipc': CUDA IPC "
    "or shared memory) and from disk; the torch "
    "profiler; OpenTelemetry request traces (observability_config.otlp_traces_endpoint, "
    "collect_detailed_traces); request logs (logging_config.enable_log_requests, max_log_len); "
    "scheduler_config.stream_interval; KV cache events (kv_events_config, publisher 'zmq' or 'null'); "
    "KV connectors SharedStorageConnector (disaggregated prefill through a shared directory), "
    "OffloadingConnector (kv_offloading_size with kv_offloading_backend='native') and MultiConnector; "
    "LoRA adapters in the PEFT format on the attention and MLP projections of generative models "
    "(lora_config: max_loras, max_cpu_loras, max_lora_rank, lora_dtype; not fully_sharded_loras); "
    "speculative decoding with the ngram, suffix, draft_model, eagle and eagle3 methods (EAGLE heads of "
    "Llama-family targets); "
    "output watermarking (watermark_config: gumbel, dual_key_gumbel, kgw)"
)

# The mixture-of-experts architectures of pagedllm.models.registry (any other `is_moe` model is refused).
MOE_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})

_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Kernel providers pagedllm ships for the IR ops (kernel_config.ir_op_priority).
_KERNEL_PROVIDERS = ("native",)

# Options of weight_transfer_config.extra (read by pagedllm.worker.weight_update).
WEIGHT_TRANSFER_EXTRA = ("timeout_s", "packed_buffer_size_bytes")

_MLA_PASSES = ("fuse_rope_kvcache_cat_mla", "fuse_mla_dual_rms_norm")

_allow_depth = 0


def _changed(obj: Any, names: Iterable[str] | None = None) -> list[str]:
    """Fields of a sub-config (all, or `names`) whose value differs from the declared default.

    Used for options that only mean something to a feature pagedllm lacks: leaving them at the default
    is fine, setting them would otherwise be silently ignored."""
    fields = obj.__pydantic_fields__
    changed = []
    for name in fields if names is None else names:
        info = fields[name]
        default = info.default_factory() if info.default_factory is not None else info.default
        if getattr(obj, name) != default:
            changed.append(name)
    return changed


# (enabled, the flag that enables it and what it is)
Check = tuple[bool, str]


def _named(prefix: str, names: list[str], what: str) -> Check:
    return bool(names), f"{', '.join(f'{prefix}.{n}' for n in names)} ({what})"


def _checks(cfg: EngineConfig) -> list[Check]:
    """(enabled, flag) for every feature outside SUPPORTED, grouped by sub-config, in message order."""
    return [
        *_speculative_checks(cfg.speculative_config),
        *_lora_checks(cfg),
        # Features whose worker side is written for one rank (each would need per-rank sharding).
        *_single_rank_only(cfg),
        *_kv_transfer_checks(cfg),
        *_feature_config_checks(cfg),
        *_data_parallel_checks(cfg),
        *_parallel_checks(cfg),
        *_cache_checks(cfg),
        *_scheduler_checks(cfg),
        *_kernel_checks(cfg),
        *_observability_checks(cfg),
        *_load_checks(cfg),
        _fusion_pass_check(cfg),
        *_model_checks(cfg),
    ]


def _lora_checks(cfg: EngineConfig) -> list[Check]:
    lora, mc = cfg.lora_config, cfg.model_config
    return [
        (
            lora is not None and lora.fully_sharded_loras,
            "lora_config.fully_sharded_loras (needs tensor parallelism)",
        ),
        (
            lora is not None and mc is not None and mc.pooler_config is not None,
            "lora_config with a pooling model (LoRA serves generative models)",
        ),
    ]


def _kv_transfer_checks(cfg: EngineConfig) -> list[Check]:
    kv = cfg.kv_transfer_config
    return [
        _unregistered_connectors(cfg),
        (
            kv is not None and kv.kv_connector is not None and kv.kv_role is None,
            "kv_transfer_config.kv_connector without kv_transfer_config.kv_role "
            "(set one of kv_producer, kv_consumer, kv_both)",
        ),
        (
            cfg.cache_config.calculate_kv_scales
            and kv is not None
            and "SharedStorageConnector" in kv.connector_names(),
            "cache_config.calculate_kv_scales with SharedStorageConnector (stored blocks carry the fp8 "
            "scales of the engine that stored them)",
        ),
    ]


def _feature_config_checks(cfg: EngineConfig) -> list[Check]:
    """The smaller feature sub-configs (features.py and friends)."""
    wt, reasoning = cfg.weight_transfer_config, cfg.reasoning_config
    wt_extra = sorted(set(wt.extra) - set(WEIGHT_TRANSFER_EXTRA)) if wt is not None else []
    return [
        (cfg.ec_transfer_config is not None, "ec_transfer_config (encoder-cache transfer)"),
        (
            cfg.ec_manager_config.manager_cls is not None,
            "ec_manager_config.manager_cls (custom encoder cache)",
        ),
        (cfg.diffusion_config is not None, "diffusion_config (diffusion LLM decoding)"),
        (cfg.engram_config is not None, "engram_config (engram layers)"),
        (
            reasoning is not None and not reasoning.reasoning_parser,
            "reasoning_config without reasoning_parser (reasoning token budgets)",
        ),
        _named(
            "reasoning_config",
            reasoning.parser_markers_differ() if reasoning is not None else [],
            "markers other than the reasoning parser's",
        ),
        (
            bool(wt_extra),
            f"weight_transfer_config.extra keys {wt_extra} (known: {', '.join(WEIGHT_TRANSFER_EXTRA)})",
        ),
        (bool(cfg.additional_config), "additional_config (options for platform plug-ins; pagedllm has none)"),
        (cfg.aux_output_config.enabled, "aux_output_config.return_routed_experts (auxiliary outputs)"),
        (cfg.attention_config.hisparse_config is not None, "attention_config.hisparse_config (HiSparse)"),
        (cfg.offload_config.cpu_offload_gb > 0, "offload_config.cpu_offload_gb (weight offloading)"),
    ]


def _parallel_checks(cfg: EngineConfig) -> list[Check]:
    pc = cfg.parallel_config
    return [
        (pc.decode_context_parallel_size > 1, "parallel_config.decode_context_parallel_size > 1"),
        (pc.prefill_context_parallel_size > 1, "parallel_config.prefill_context_parallel_size > 1"),
        (pc.enable_dbo, "parallel_config.enable_dbo (dual batch overlap)"),
        (pc.enable_expert_parallel, "parallel_config.enable_expert_parallel (expert parallelism)"),
        (pc.enable_eplb, "parallel_config.enable_eplb (expert load balancing)"),
        (bool(pc.enable_batch_sharded_sampling), "parallel_config.enable_batch_sharded_sampling"),
        (
            pc.tensor_parallel_size > 1 and _quantized(cfg),
            "parallel_config.tensor_parallel_size > 1 with quantization (quantized layers are not sharded)",
        ),
        _named(
            "parallel_config",
            _changed(pc, ("dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size", "dcp_comm_backend")),
            "context parallelism",
        ),
        _named(
            "parallel_config",
            _changed(pc, ("expert_placement_strategy", "all2all_backend")),
            "expert parallelism",
        ),
        (pc.enable_fault_tolerance, "parallel_config.enable_fault_tolerance (worker fault tolerance)"),
    ]


def _quantized(cfg: EngineConfig) -> bool:
    mc = cfg.model_config
    return cfg.quant_config is not None or (mc is not None and mc.quantization is not None)


def _cache_checks(cfg: EngineConfig) -> list[Check]:
    cc = cfg.cache_config
    return [
        (cc.kv_sharing_fast_prefill, "cache_config.kv_sharing_fast_prefill"),
        (cc.use_replayssm, "cache_config.use_replayssm (Mamba state replay)"),
        (cc.mamba_block_size is not None, "cache_config.mamba_block_size (Mamba state cache)"),
        _named(
            "cache_config",
            _changed(cc, ("mamba_cache_mode", "mamba_ssm_cache_dtype", "replayssm_buffer_len")),
            "Mamba state cache",
        ),
        (
            cc.kv_offloading_backend != "native",
            f"cache_config.kv_offloading_backend={cc.kv_offloading_backend!r} (KV offloading)",
        ),
    ]


def _scheduler_checks(cfg: EngineConfig) -> list[Check]:
    sc, backend = cfg.scheduler_config, cfg.structured_outputs_config.backend
    return [
        (sc.scheduler_cls is not None, "scheduler_config.scheduler_cls (custom schedulers)"),
        (
            sc.runner_type not in ("generate", "pooling"),
            f"scheduler_config.runner_type={sc.runner_type!r} (only 'generate' and 'pooling')",
        ),
        (sc.disable_chunked_mm_input, "scheduler_config.disable_chunked_mm_input (multimodal inputs)"),
        (
            backend in ("outlines", "lm-format-enforcer"),
            f"structured_outputs_config.backend={backend!r} (only 'auto', 'xgrammar' and 'guidance')",
        ),
    ]


def _kernel_checks(cfg: EngineConfig) -> list[Check]:
    priority = cfg.kernel_config.ir_op_priority
    providers = sorted(
        {p for p in (*priority.rms_norm, *priority.fused_add_rms_norm) if p not in _KERNEL_PROVIDERS}
    )
    return [
        _named("mamba_config", _changed(cfg.mamba_config), "Mamba kernels"),
        (
            cfg.attention_config.backend not in (None, "torch_paged"),
            f"attention_config.backend={cfg.attention_config.backend!r} (only torch_paged)",
        ),
        (
            bool(providers),
            f"kernel_config.ir_op_priority providers {providers} (only {', '.join(_KERNEL_PROVIDERS)})",
        ),
    ]


def _observability_checks(cfg: EngineConfig) -> list[Check]:
    prof = cfg.profiler_config
    return [
        (
            cfg.observability_config.show_hidden_metrics_for_version is not None,
            "observability_config.show_hidden_metrics_for_version (no metrics are hidden)",
        ),
        (prof.profiler == "proton", "profiler_config.profiler='proton' (only 'torch')"),
        _named(
            "profiler_config", _changed(prof, ("proton_graph_attribution", "proton_mode")), "proton profiler"
        ),
        (
            prof.profiler is None and bool(prof.torch_profiler_dir),
            "profiler_config.torch_profiler_dir without profiler_config.profiler='torch'",
        ),
        (
            prof.profiler == "torch" and not prof.torch_profiler_dir,
            "profiler_config.profiler='torch' without profiler_config.torch_profiler_dir (where traces go)",
        ),
    ]


def _load_checks(cfg: EngineConfig) -> list[Check]:
    lc = cfg.load_config
    return [
        (lc.load_format not in _LOAD_FORMATS, f"load_config.load_format={lc.load_format!r}"),
        _named(
            "load_config.model_loader_extra_config",
            sorted(set(lc.model_loader_extra_config) - {"gguf_dequantize"}),
            "custom weight-loader options; supported: gguf_dequantize",
        ),
    ]


def _fusion_pass_check(cfg: EngineConfig) -> Check:
    # MLA-only passes do nothing for the (non-MLA) models pagedllm runs; MLA models are rejected below.
    # Passes run only inside pagedllm's own compilation (VLLM_COMPILE); without it (enforce_eager, modes 0-2)
    # the level defaults may still switch them on, but nothing would apply them.
    compiled = cfg.compilation_config.mode == CompilationMode.VLLM_COMPILE
    passes = cfg.compilation_config.pass_config.enabled_passes() if compiled else []
    enabled = [p for p in passes if p not in _MLA_PASSES]
    return bool(enabled), f"compilation_config.pass_config {', '.join(enabled)} (fusion passes)"


def _model_checks(cfg: EngineConfig) -> list[Check]:
    mc = cfg.model_config
    if mc is None:
        return []
    moe = MOE_ARCHITECTURES
    return [
        (mc.multimodal_config is not None, "model_config.multimodal_config (multimodal models)"),
        (mc.runner == "draft", "model_config.runner='draft' (draft models of speculative decoding)"),
        (mc.convert == "classify", "model_config.convert='classify' (classification adapters)"),
        (mc.enable_prompt_embeds, "model_config.enable_prompt_embeds"),
        (mc.sleep_mode_offload_cudagraph, "model_config.sleep_mode_offload_cudagraph (sleep mode)"),
        (mc.enable_cumem_allocator, "model_config.enable_cumem_allocator (cuMem allocator)"),
        (mc.return_sampling_mask, "model_config.return_sampling_mask (sampling replay)"),
        (mc.enable_trace_replay, "model_config.enable_trace_replay"),
        (bool(mc.logits_processors), "model_config.logits_processors (custom logits processors)"),
        (bool(mc.model_weights), "model_config.model_weights (separate weight location)"),
        (
            mc.is_moe and mc.architecture not in moe,
            f"mixture-of-experts model {mc.architecture} (supported: {', '.join(sorted(moe))})",
        ),
        (mc.is_hybrid, f"hybrid attention/SSM model {mc.architecture}"),
        (mc.use_mla, f"MLA attention model {mc.architecture}"),
    ]


def _unregistered_connectors(cfg: EngineConfig) -> Check:
    """KV connectors outside pagedllm's registry (NixlConnector, P2pNcclConnector, LMCacheConnectorV1, ...)."""
    kv = cfg.kv_transfer_config
    if kv is None or kv.kv_connector is None:
        return False, ""
    known = KV_CONNECTORS
    missing = [name for name in kv.connector_names() if name not in known]
    return bool(missing), f"kv_transfer_config.kv_connector {', '.join(missing)} (supported: {', '.join(known)})"


def _single_rank_only(cfg: EngineConfig) -> list[Check]:
    pc = cfg.parallel_config
    if pc.tensor_parallel_size * pc.pipeline_parallel_size == 1:
        return []
    kv = cfg.kv_transfer_config
    return [
        (cfg.lora_config is not None, "lora_config with tensor or pipeline parallelism"),
        (cfg.speculative_config is not None, "speculative_config with tensor or pipeline parallelism"),
        (
            kv is not None and kv.kv_connector is not None,
            "kv_transfer_config.kv_connector / kv_offloading_size with tensor or pipeline parallelism",
        ),
    ]


def _data_parallel_checks(cfg: EngineConfig) -> list[Check]:
    pc = cfg.parallel_config
    if pc.data_parallel_size == 1:
        return []
    return [
        (
            pc.distributed_executor_backend in ("ray", "external_launcher"),
            f"data parallelism with distributed_executor_backend={pc.distributed_executor_backend!r} "
            "(each data parallel engine core runs 'uni' or 'mp' workers)",
        ),
        (
            cfg.weight_transfer_config is not None,
            "weight_transfer_config with data parallelism (a trainer's group spans one engine's workers)",
        ),
    ]


def check_in_process(cfg: EngineConfig) -> None:
    """Raise ValueError for what the offline engine (`LLM`, `LLMEngine`: one engine core in the calling
    process) cannot run although the server can: data parallelism with internal load balancing."""
    if _allow_depth:
        return
    pc = cfg.parallel_config
    if pc.data_parallel_size > 1 and not pc.data_parallel_external_lb:
        raise ValueError(
            f"data_parallel_size={pc.data_parallel_size} is not supported offline (LLM and LLMEngine run one "
            "engine core in this process): serve the model with `pagedllm serve --data-parallel-size "
            f"{pc.data_parallel_size}`, or run one LLM per rank with data_parallel_external_lb=True and "
            "data_parallel_rank=<rank>"
        )


def _speculative_checks(spec: Any) -> list[Check]:
    if spec is None:
        return []
    return [
        (
            spec.method not in IMPLEMENTED_METHODS,
            f"speculative_config.method={spec.method!r} (speculative decoding methods other than "
            f"{', '.join(IMPLEMENTED_METHODS)})",
        ),
        (
            spec.method in ("draft_model", "eagle", "eagle3") and not spec.model,
            f"speculative_config.method={spec.method!r} without speculative_config.model (the draft model)",
        ),
        (spec.parallel_drafting, "speculative_config.parallel_drafting (parallel drafting)"),
        (spec.enable_adaptive_verification, "speculative_config.enable_adaptive_verification"),
        (spec.use_heterogeneous_vocab, "speculative_config.use_heterogeneous_vocab"),
    ]


def unsupported_features(cfg: EngineConfig) -> list[str]:
    """Every enabled feature pagedllm does not implement, each naming its flag."""
    return [name for enabled, name in _checks(cfg) if enabled]


def _message(found: list[str]) -> str:
    return "pagedllm does not support: " + "; ".join(found) + f". Supported: {SUPPORTED}."


def check_supported(cfg: EngineConfig) -> None:
    """Raise ValueError naming every enabled feature outside SUPPORTED (unless the gate is lifted)."""
    if _allow_depth:
        return
    found = unsupported_features(cfg)
    if found:
        raise ValueError(_message(found))


def unsupported_error(cfg: EngineConfig, cause: BaseException) -> ValueError | None:
    """The "not supported" error for a construction that failed with `cause`, if it used a feature
    outside SUPPORTED; None otherwise (or with the gate lifted).

    Why: an unimplemented feature often trips one of its own consistency rules before the gate runs
    (HiSparse off CUDA, DBO without a DeepEP backend); the user must learn that the feature itself is
    unsupported, not how to make it consistent."""
    if _allow_depth:
        return None
    try:
        found = unsupported_features(cfg)
    except Exception:  # the half-built config may lack what a check reads; keep the original error
        return None
    if not found:
        return None
    return ValueError(f"{_message(found)} (Construction also reported: {cause})")


@contextlib.contextmanager
def allow_unsupported() -> Iterator[None]:
    """Build configs with unimplemented features (algorithm tests, planning); never for running."""
    global _allow_depth
    _allow_depth += 1
    try:
        yield
    finally:
        _allow_depth -= 1
