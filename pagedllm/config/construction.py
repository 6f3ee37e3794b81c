"""EngineConfig construction: the spec's procedure P01-P72, in order (see CONFIG_SPEC.md section 4).

Every [core] step runs as written. [exotic] steps (multimodal, Mamba, MoE/EP/DBO, HiSparse, engram,
diffusion) keep their cheap checks; the features themselves are rejected afterwards by
`pagedllm.config.support`, so their checks only matter for configs built with the gate lifted."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from pagedllm import envs
from pagedllm.config import construction_checks as checks
from pagedllm.config import graph_sizes
from pagedllm.config.compilation import CompilationMode, CUDAGraphMode
from pagedllm.config.construction_exotic import (
    check_early_exotic,
    check_hisparse,
    check_late_exotic,
    check_model_exotic,
    check_moonep,
    resolve_engram,
    resolve_fast_moe_cold_start,
    resolve_multimodal,
    verify_aux_output_compatibility,
)
from pagedllm.config.optimization import OPTIMIZATION_LEVEL_TO_CONFIG, apply_optimization_level_defaults
from pagedllm.config.pooler import apply_pooling_defaults
from pagedllm.config.quantization import QuantizationConfig, get_quantization_method
from pagedllm.config.runner_select import validate_model_runner
from pagedllm.config.utils import info_once, warning_once
from pagedllm.config.watermark_check import check_supports_watermarking

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig
    from pagedllm.config.load import LoadConfig
    from pagedllm.config.model import ModelConfig

logger = logging.getLogger("pagedllm.config")

_OBJECT_STORAGE_PREFIXES = ("s3://", "gs://", "az://", "abfs://")


def _platform() -> Any:
    from pagedllm.platforms import current_platform

    return current_platform


def try_verify_and_update_config(cfg: EngineConfig) -> None:
    """P06: per-model hooks, at most once per model config."""
    mc = cfg.model_config
    if mc is None or mc.config_updated:
        return
    mc.config_updated = True
    apply_pooling_defaults(cfg)
    if mc.architecture is None:
        return
    # pagedllm's supported architectures (models/registry.py) need no config hook; hybrid
    # and classification adapters are rejected by the support gate.
    weights = mc.model_weights
    if weights.startswith(_OBJECT_STORAGE_PREFIXES):
        lc = cfg.load_config
        if lc.load_format == "auto":
            logger.info("object-storage weights %s: using load_format=runai_streamer", weights)
            lc.load_format = "runai_streamer"
        elif lc.load_format not in ("modelexpress", "runai_streamer", "runai_streamer_sharded"):
            raise ValueError(
                f"load_format={lc.load_format!r} cannot load object-storage weights of {mc.model!r}; "
                "use runai_streamer, runai_streamer_sharded or modelexpress"
            )


def resolve_quantization_config(mc: ModelConfig, load_config: LoadConfig) -> QuantizationConfig | None:
    """Spec 5.18."""
    if mc.quantization is None:
        return None
    quant = get_quantization_method(mc.quantization)
    cap = _platform().get_device_capability()
    if cap is not None and cap.to_int() < quant.get_min_capability():
        raise ValueError(
            f"quantization {mc.quantization!r} needs device capability >= {quant.get_min_capability()}, "
            f"this device has {cap.to_int()}"
        )
    if mc.dtype not in quant.get_supported_act_dtypes():
        raise ValueError(
            f"dtype {mc.dtype} is not supported with quantization {mc.quantization!r}; supported: "
            f"{quant.get_supported_act_dtypes()}"
        )
    quant.maybe_update_config(mc.model, hf_config=mc.hf_config, revision=mc.revision)
    return quant


def _blocked_weights(quant: Any) -> bool:
    if quant is None:
        return False
    if hasattr(quant, "weight_block_size"):
        return quant.weight_block_size is not None
    if hasattr(quant, "has_blocked_weights"):
        return bool(quant.has_blocked_weights())
    return False


def _maybe_add_quant_fp8(cfg: EngineConfig) -> None:
    ops = cfg.compilation_config.custom_ops
    if _blocked_weights(cfg.quant_config) and "-quant_fp8" not in ops:
        ops.append("+quant_fp8")


def _normalize_piecewise(cfg: EngineConfig, breakable: bool) -> None:
    """P41/P50: piecewise graphs need pagedllm compilation; otherwise drop the piecewise part."""
    cc = cfg.compilation_config
    mode = cc.cudagraph_mode
    if mode is None or not mode.requires_piecewise_compilation():
        return
    if cc.mode == CompilationMode.VLLM_COMPILE or breakable:
        return
    fallback = mode.without_piecewise()
    compile_name = cc.mode.name if cc.mode is not None else None
    info_once(
        f"cudagraph_mode {mode.name} is not compatible with compilation mode {compile_name}; "
        f"overriding to {fallback.name}"
    )
    cc.cudagraph_mode = fallback
    if fallback == CUDAGraphMode.NONE:
        cc.max_cudagraph_capture_size = 0
        cc.cudagraph_capture_sizes = []


def _graph_sizing(cfg: EngineConfig) -> None:
    """P44."""
    cc, mc = cfg.compilation_config, cfg.model_config
    if not _platform().support_static_graph_mode():
        # Spec 7.10 leaves the sizes as given here; pagedllm decides "graphs off => no capture sizes"
        # on every platform, so readers never see None and user sizes are dropped visibly.
        if cc.cudagraph_capture_sizes or cc.max_cudagraph_capture_size:
            warning_once(
                f"{_platform().device_type} has no CUDA graphs: ignoring cudagraph_capture_sizes="
                f"{cc.cudagraph_capture_sizes} and max_cudagraph_capture_size={cc.max_cudagraph_capture_size}"
            )
        cc.cudagraph_mode = CUDAGraphMode.NONE
        cc.max_cudagraph_capture_size = 0
        cc.cudagraph_capture_sizes = []
        cc.post_init_cudagraph_sizes()
        return
    mode = cc.cudagraph_mode
    assert mode is not None
    if mc is not None:
        if mode.has_full_cudagraphs() and mc.pooler_config is not None:
            warning_once("pooling models cannot use full CUDA graphs; using PIECEWISE")
            cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
        elif mc.is_encoder_decoder and mode not in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
            logger.info("encoder-decoder models use FULL_DECODE_ONLY CUDA graphs")
            cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    kv = cfg.kv_transfer_config
    if kv is not None and kv.is_kv_transfer_instance and cc.cudagraph_mode.has_full_cudagraphs():
        # pagedllm has no connector classes; every connector would need the conservative mode.
        warning_once(f"KV connector {kv.kv_connector} requires PIECEWISE CUDA graphs")
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    if mc is not None and mc.enforce_eager:
        info_once("CUDA graphs are disabled under enforce_eager")
        cc.cudagraph_mode = CUDAGraphMode.NONE
        cc.max_cudagraph_capture_size = 0
        cc.cudagraph_capture_sizes = []
    else:
        cc.cudagraph_num_of_warmups = 1
    graph_sizes.set_cudagraph_sizes(cfg)


def _maybe_enable_breakable_cudagraph(cfg: EngineConfig) -> bool:
    """P29 / spec 5.19."""
    mc = cfg.model_config
    # The decision is returned, not written back to the environment as the reference does: config
    # construction never changes os.environ.
    enabled = envs.PAGEDLLM_USE_BREAKABLE_CUDAGRAPH
    if enabled is None and mc is not None:
        breakable_archs = _platform().default_breakable_cudagraph_architectures()
        enabled = bool(set(mc.architectures) & breakable_archs)
        if enabled:
            info_once(f"using breakable CUDA graphs for {mc.architecture}")
    # The upstream batch-invariance trigger needs tuned matmul tables per GPU family; pagedllm ships
    # none, so that heuristic never holds and only the architecture set and the variable decide.
    if enabled:
        cfg.compilation_config.mode = CompilationMode.NONE
    return enabled


def construct(cfg: EngineConfig) -> None:  # noqa: C901 - one step per spec paragraph, in order
    cfg.instance_id = str(time.time_ns())  # P01
    mc, cc, pc, sc = cfg.model_config, cfg.compilation_config, cfg.parallel_config, cfg.scheduler_config
    if mc is not None and mc.is_submodel_config:  # P02
        return
    check_early_exotic(cfg)  # P03, P04
    if cfg.performance_mode != "balanced":  # P05
        info_once(f"performance_mode={cfg.performance_mode}")
    try_verify_and_update_config(cfg)  # P06
    resolve_engram(cfg)  # P07
    check_supports_watermarking(cfg)  # P08
    pc.set_dcp_defaults()  # P09
    if mc is not None:  # P10
        mc.verify_with_parallel_config(pc)
        mc.verify_dual_chunk_attention_config(cfg.load_config)
        pc.is_moe_model = mc.is_moe
        # The scheduler enforces the model's context length; keep both in step.
        if sc.max_model_len is None:
            sc.max_model_len = mc.max_model_len
            if not sc.enable_chunked_prefill and sc.max_num_batched_tokens_defaulted:
                assert sc.max_num_batched_tokens is not None and mc.max_model_len is not None
                sc.max_num_batched_tokens = max(sc.max_num_batched_tokens, mc.max_model_len)
        sc.verify()
    check_model_exotic(cfg)  # P11-P14
    if cfg.lora_config is not None:  # P15
        cfg.lora_config.verify_with_model_config(mc)
    if (
        cfg.mamba_config.enable_stochastic_rounding and cfg.cache_config.mamba_ssm_cache_dtype != "float16"
    ):  # P16
        raise ValueError(
            "mamba_config.enable_stochastic_rounding needs cache_config.mamba_ssm_cache_dtype='float16'"
        )
    if cfg.quant_config is None and mc is not None:  # P17
        cfg.quant_config = resolve_quantization_config(mc, cfg.load_config)
    if mc is not None and cfg.load_config.load_format not in (
        "dummy",
        "sharded_state",
        "runai_streamer_sharded",
    ):
        mc.maybe_untie_word_embeddings()  # P18
    quant = cfg.quant_config
    if quant is not None and getattr(quant, "use_deep_gemm", False) is None:  # P19
        # pagedllm has no DeepGEMM kernels, so the auto-disable list covers every model type.
        warning_once(f"DeepGEMM is disabled for model_type={mc.model_type if mc else None}")
        quant.use_deep_gemm = False
    executor_async = (
        pc.executor_supports_async_scheduling() and _platform().supports_async_scheduling()
    )  # P20
    rocm_deepep_ht_dbo = (
        _platform().is_rocm() and pc.enable_dbo and pc.all2all_backend == "deepep_high_throughput"
    )
    checks.resolve_async_scheduling(cfg, executor_async, rocm_deepep_ht_dbo)  # P21
    if pc.disable_nccl_for_dp_synchronization is None:  # P22
        if sc.async_scheduling:
            if pc.data_parallel_size > 1 and (mc is None or mc.is_moe):
                info_once("async scheduling: data parallel ranks synchronize over gloo")
            pc.disable_nccl_for_dp_synchronization = True
        else:
            pc.disable_nccl_for_dp_synchronization = False
    spec = cfg.speculative_config
    if spec is not None and sc.async_scheduling and mc is not None and not mc.disable_cascade_attn:  # P23
        warning_once("cascade attention is disabled with async scheduling and speculative decoding")
        mc.disable_cascade_attn = True
    if cfg.observability_config.per_request_spec_decode_metrics != "none" and spec is None:  # P24
        raise ValueError("per_request_spec_decode_metrics needs speculative decoding (speculative_config)")
    mm = mc.multimodal_config if mc is not None else None
    if mm and mm.get("mm_tensor_ipc") == "torch_shm":  # P25
        if envs.PAGEDLLM_WORKER_MULTIPROC_METHOD != "spawn":
            raise ValueError("mm_tensor_ipc='torch_shm' needs PAGEDLLM_WORKER_MULTIPROC_METHOD=spawn")
    if (  # P26
        mc is not None
        and sc.enable_chunked_prefill
        and mc.dtype == torch.float32
        and _platform().is_device_capability((7, 5))
    ):
        warning_once("Turing GPU with float32 and chunked prefill: kernels use IEEE precision")
    if mc is not None and mc.enforce_eager:  # P27
        cc.mode = CompilationMode.NONE
        cc.cudagraph_mode = CUDAGraphMode.NONE
        if pc.enable_fault_tolerance:
            warning_once("enforce_eager: compilation and CUDA graphs are disabled (JIT warm-up kept)")
        else:
            warning_once("enforce_eager: compilation, CUDA graphs and JIT warm-up are disabled")
            cfg.kernel_config.enable_jit_warmup = False
    if envs.TORCH_COMPILE_DISABLE:  # P28
        warning_once("TORCH_COMPILE_DISABLE=1: compilation is disabled")
        cc.mode = CompilationMode.NONE
    breakable = _maybe_enable_breakable_cudagraph(cfg)  # P29
    if not breakable and (
        cc.backend == "eager" or (cc.mode is not None and cc.mode != CompilationMode.VLLM_COMPILE)
    ):
        warning_once(
            "Inductor compilation was disabled by user settings; inductor-only optimizations are ignored"
        )  # P30
    _maybe_add_quant_fp8(cfg)  # P31
    _platform().apply_config_platform_defaults(cfg)  # P32
    if cc.mode is None:  # P33
        cc.mode = CompilationMode.VLLM_COMPILE if cfg.optimization_level > 0 else CompilationMode.NONE
    if cc.ir_enable_torch_wrap is None:  # P34
        cc.ir_enable_torch_wrap = cc.mode == CompilationMode.VLLM_COMPILE and cc.backend == "inductor"
    if "all" not in cc.custom_ops and "none" not in cc.custom_ops:  # P35
        cc.custom_ops.append(
            "none" if cc.backend == "inductor" and cc.mode != CompilationMode.NONE else "all"
        )
    cfg.kernel_config.set_platform_defaults(cfg)  # P36
    apply_optimization_level_defaults(cfg, OPTIMIZATION_LEVEL_TO_CONFIG[int(cfg.optimization_level)])  # P37
    if cfg.kernel_config.enable_flashinfer_autotune is None:
        raise ValueError("kernel_config.enable_flashinfer_autotune must be set after applying level defaults")
    if spec is not None and spec.uses_dynamic_speculative_decoding() and pc.data_parallel_size > 1:  # P38
        warning_once("dynamic speculative decoding is off under data parallelism (ranks could deadlock)")
        spec.num_speculative_tokens_per_batch_size = None
    if (  # P39
        spec is not None
        and spec.uses_dynamic_speculative_decoding()
        and cc.cudagraph_mode is not None
        and cc.cudagraph_mode.has_full_cudagraphs()
        and not cfg.use_v2_model_runner
    ):
        warning_once("dynamic speculative decoding needs PIECEWISE CUDA graphs on the V1 runner")
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    check_hisparse(cfg)  # P40
    _normalize_piecewise(cfg, breakable)  # P41
    resolve_fast_moe_cold_start(cfg)  # P42
    graph_sizes.set_max_num_scheduled_tokens(cfg)  # P43
    _graph_sizing(cfg)  # P44
    check_late_exotic(cfg)  # P45, P46
    kve = cfg.kv_events_config  # P47
    if kve is not None:
        if kve.enable_kv_cache_events and not cfg.cache_config.enable_prefix_caching:
            warning_once("KV cache events are enabled but prefix caching is off: no events will be published")
        if kve.publisher != "null" and not kve.enable_kv_cache_events:
            warning_once(f"KV events publisher {kve.publisher!r} is set but enable_kv_cache_events=False")
    _platform().check_and_update_config(cfg)  # P48
    if cfg.diffusion_config is not None and sc.scheduler_cls is None:  # P49
        module = "pagedllm.core.diffusion_scheduler"
        sc.scheduler_cls = (
            f"{module}.AsyncDiffusionScheduler" if sc.async_scheduling else f"{module}.DiffusionScheduler"
        )
    _normalize_piecewise(cfg, breakable)  # P50
    resolve_multimodal(cfg)  # P51
    validate_model_runner(cfg)  # P52
    checks.validate_profiler(cfg)  # P53
    checks.validate_batch_sharded_sampling(cfg)  # P54
    checks.validate_adaptive_verification(cfg)  # P55
    graph_sizes.set_compile_ranges(cfg)  # P56
    check_moonep(cfg)  # P57
    effective_dp = pc.data_parallel_size if (mc is None or mc.is_moe) else 1
    cc.set_splitting_ops_for_v1(all2all_backend=pc.all2all_backend, data_parallel_size=effective_dp)  # P58
    checks.final_cuda_checks(cfg, breakable)  # P59
    if mc is not None and envs.PAGEDLLM_BATCH_INVARIANT and not mc.disable_cascade_attn:  # P60
        warning_once("batch invariance: cascade attention is disabled")
        mc.disable_cascade_attn = True
    if pc.use_ubatching:  # P61
        assert pc.all2all_backend in ("deepep_low_latency", "deepep_high_throughput", "nixl_ep"), (
            f"dual batch overlap needs a DeepEP or NIXL-EP all2all backend, not {pc.all2all_backend}"
        )
        if mc is not None and not mc.disable_cascade_attn:
            warning_once("dual batch overlap: cascade attention is disabled")
            mc.disable_cascade_attn = True
    if not cfg.instance_id:  # P62
        cfg.instance_id = str(uuid.uuid4())[:5]
    if cfg.reasoning_config is not None and mc is not None:  # P63
        cfg.reasoning_config.initialize_token_ids(mc)
        if not cfg.reasoning_config.enabled:
            # The chat server still splits the text; only token-level reasoning detection is off.
            warning_once(
                "the reasoning parser's markers are not single tokens of this vocabulary: the engine cannot "
                "see where the reasoning ends, so structured outputs constrain the whole output"
            )
    checks.post_init_kv_transfer_config(cfg)  # P64
    verify_aux_output_compatibility(cfg)  # P65
    checks.resolve_hybrid_kv_cache_manager(cfg)  # P66
    if cfg.attention_config.hisparse_config is not None and sc.disable_hybrid_kv_cache_manager:  # P67
        raise ValueError("HiSparse needs the hybrid KV cache manager, which is disabled")
    checks.resolve_debug_dump_path(cfg)  # P68
    _maybe_add_quant_fp8(cfg)  # P69
    kv = cfg.kv_transfer_config  # P70
    if kv is not None and kv.kv_connector is not None:
        alloc = envs.PYTORCH_CUDA_ALLOC_CONF or ""
        if "expandable_segments:True" in alloc and not (mc is not None and mc.enable_cumem_allocator):
            raise ValueError(
                "KV connectors register KV memory, which PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "remaps; unset that option or enable the cuMem allocator (enable_cumem_allocator=True)"
            )
    if cfg.use_cumem_cudagraph_pool:  # P71
        # The reference writes NCCL_GRAPH_REGISTER=0 when unset; pagedllm's config never writes
        # os.environ, and it creates no NCCL communicator yet, so only a conflicting value is reported.
        current = envs.NCCL_GRAPH_REGISTER
        if current is not None and current != "0":
            logger.warning("NCCL_GRAPH_REGISTER=%s with CUDA graphs in the cuMem pool may fail", current)
    cc.pass_config.log_enabled_passes()  # P72
