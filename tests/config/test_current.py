"""The current-config context, layer lookup, level defaults and fusion predicates, small methods."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from config_testing import build_cuda

from pagedllm.config import (
    OPTIMIZATION_LEVEL_TO_CONFIG,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    enable_act_fusion,
    enable_allreduce_rms_fusion,
    enable_norm_fusion,
    enable_rope_kvcache_mla_fusion,
    get_cached_compilation_config,
    get_current_config,
    get_layers_from_config,
    set_current_config,
)
from pagedllm.config.current import compilation_counter, get_current_prefix
from pagedllm.config.optimization import apply_optimization_level_defaults
from pagedllm.platforms import override_platform


def test_set_current_config_nests_and_restores() -> None:
    outer, inner = EngineConfig(), EngineConfig()
    with set_current_config(outer, prefix="model"):
        assert get_current_config() is outer and get_current_prefix() == "model"
        assert get_cached_compilation_config() is outer.compilation_config
        with set_current_config(inner):
            assert get_current_config() is inner
            assert get_cached_compilation_config() is inner.compilation_config
        assert get_current_config() is outer and get_cached_compilation_config() is outer.compilation_config
    assert get_current_prefix() is None
    assert get_current_config() is not outer


def test_set_current_config_restores_on_error() -> None:
    cfg = EngineConfig()
    with pytest.raises(RuntimeError), set_current_config(cfg):
        raise RuntimeError("boom")
    assert get_current_config() is not cfg


def test_check_compile_warns_when_model_not_compiled(caplog: pytest.LogCaptureFixture) -> None:
    cfg = EngineConfig(model_config=ModelConfig())
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        with set_current_config(cfg, check_compile=True):
            pass
    assert "does not support it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        with set_current_config(cfg, check_compile=True):
            compilation_counter.num_models_seen += 1
    assert "does not support it" not in caplog.text


def test_get_layers_from_config() -> None:
    class Attn:
        pass

    cfg = EngineConfig()
    a, b = Attn(), Attn()
    cfg.compilation_config.static_forward_context.update({"l0.attn": a, "l0.mlp": object(), "l1.attn": b})
    assert get_layers_from_config(cfg, Attn) == {"l0.attn": a, "l1.attn": b}
    assert get_layers_from_config(cfg, Attn, ["l1.attn", "missing", "l0.mlp"]) == {"l1.attn": b}


def test_level_table_defines_autotune_everywhere() -> None:
    for level in range(4):
        assert OPTIMIZATION_LEVEL_TO_CONFIG[level]["kernel_config"]["enable_flashinfer_autotune"] is (
            level > 0
        )
    assert OPTIMIZATION_LEVEL_TO_CONFIG[2] == OPTIMIZATION_LEVEL_TO_CONFIG[3]


def test_apply_defaults_fills_only_none() -> None:
    cfg = EngineConfig()
    cc = CompilationConfig(cudagraph_mode="NONE", pass_config={"fuse_norm_quant": False})
    cfg.compilation_config = cc
    cc.pass_config.fuse_act_quant = None
    seen = []

    def probe(root: EngineConfig) -> bool:
        seen.append(root)
        return True

    apply_optimization_level_defaults(
        cfg,
        {
            "compilation_config": {
                "cudagraph_mode": "FULL",
                "pass_config": {"fuse_norm_quant": True, "fuse_act_quant": probe},
                "no_such_key": 1,
            }
        },
    )
    assert cc.cudagraph_mode.name == "NONE" and cc.pass_config.fuse_norm_quant is False
    assert cc.pass_config.fuse_act_quant is True and seen == [cfg]


def test_fusion_predicates() -> None:
    cfg = build_cuda()
    assert not enable_norm_fusion(cfg) and not enable_act_fusion(cfg)
    cfg.compilation_config.custom_ops = ["none", "+rms_norm", "+silu_and_mul"]
    assert enable_norm_fusion(cfg) and enable_act_fusion(cfg)
    cfg.compilation_config.custom_ops = ["none"]
    cfg.kernel_config.ir_op_priority.rms_norm = ["other", "native"]
    assert enable_norm_fusion(cfg)
    # All-reduce fusion needs TP > 1, CUDA Hopper/Blackwell and FlashInfer (not installed here).
    with override_platform("cuda", capability=(9, 0)):
        cfg.parallel_config = ParallelConfig(tensor_parallel_size=2)
        assert enable_allreduce_rms_fusion(cfg) is False
    cfg.compilation_config.splitting_ops = ["pagedllm.kv_cache_update"]
    assert not enable_rope_kvcache_mla_fusion(cfg)
    cfg.compilation_config.use_inductor_graph_partition = True
    assert enable_rope_kvcache_mla_fusion(cfg)


def test_compile_debug_dump_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert EngineConfig().compile_debug_dump_path() is None
    cfg = EngineConfig(compilation_config=CompilationConfig(debug_dump_path=Path("dumps")))
    assert cfg.compile_debug_dump_path() == Path.cwd() / "dumps" / "rank_0_dp_0"
    monkeypatch.setenv("PAGEDLLM_DEBUG_DUMP_PATH", str(tmp_path))
    assert EngineConfig().compile_debug_dump_path() == tmp_path / "rank_0_dp_0"


def test_trace_function_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys
    import tempfile
    import threading

    cfg = EngineConfig()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_TRACE_FUNCTION", raising=False)
    cfg.enable_trace_function_call_for_thread()
    assert not any(tmp_path.rglob("*.log"))
    monkeypatch.setenv("PAGEDLLM_TRACE_FUNCTION", "1")

    def traced() -> None:
        cfg.enable_trace_function_call_for_thread()
        os.getcwd()
        sys.settrace(None)

    thread = threading.Thread(target=traced)
    thread.start()
    thread.join()
    logs = list(tmp_path.rglob("PAGEDLLM_TRACE_FUNCTION_for_process_*.log"))
    assert (
        len(logs) == 1 and f"pagedllm-instance-{cfg.instance_id}" in str(logs[0]) and " " not in logs[0].name
    )


def test_with_hf_config_makes_submodel_view() -> None:
    from transformers import Qwen2Config

    cfg = EngineConfig(model_config=ModelConfig())
    draft_hf = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    draft_hf.architectures = None
    view = cfg.with_hf_config(draft_hf)
    assert view.model_config.is_submodel_config and view.model_config.architecture == "Qwen2ForCausalLM"
    assert view.model_config.model_arch_config.hidden_size == 64
    assert cfg.model_config.architecture == "LlamaForCausalLM" and not cfg.model_config.is_submodel_config
    named = cfg.with_hf_config(draft_hf, architectures=["MyDraft"])
    assert named.model_config.architectures == ["MyDraft"] and draft_hf.architectures is None


def test_validate_block_size() -> None:
    from pagedllm.config.support import allow_unsupported

    with allow_unsupported():
        cfg = EngineConfig(
            parallel_config=ParallelConfig(decode_context_parallel_size=2, cp_kv_cache_interleave_size=3)
        )
    with pytest.raises(AssertionError, match="multiple of cp_kv_cache_interleave_size"):
        cfg.validate_block_size()
    EngineConfig().validate_block_size()


def test_str_lists_fields_in_order() -> None:
    text = str(EngineConfig(model_config=ModelConfig()))
    keys = [part.split("=", 1)[0] for part in text.split(", ") if "=" in part]
    assert keys[:3] == ["model", "speculative_config", "tokenizer"]
    assert "max_seq_len=8192" in text and "kv_cache_dtype=auto" in text and "device_config=cpu" in text
    with pytest.raises(ValueError, match="model_config"):
        str(EngineConfig())


def test_adjust_dcp_kv_cache_interleave_size(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from pagedllm.config import KVTransferConfig
    from pagedllm.config.support import allow_unsupported

    groups = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=b)) for b in (32, 16)]
    )
    with allow_unsupported():
        single = EngineConfig(parallel_config=ParallelConfig(dcp_kv_cache_interleave_size=4))
        cfg = EngineConfig(
            parallel_config=ParallelConfig(
                tensor_parallel_size=2, decode_context_parallel_size=2, dcp_kv_cache_interleave_size=4
            ),
            kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"),
        )
    single.adjust_dcp_kv_cache_interleave_size(groups)  # DCP 1: nothing to align
    assert single.parallel_config.cp_kv_cache_interleave_size == 1
    pc = cfg.parallel_config
    pc.cp_kv_cache_interleave_size = 1
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg.adjust_dcp_kv_cache_interleave_size(groups)
    assert pc.cp_kv_cache_interleave_size == 4 and "follows dcp_kv_cache_interleave_size" in caplog.text
    # With NIXL and auto-resolution allowed, the smallest KV block size wins.
    pc._allow_auto_resolve_cp_interleave_size = True
    cfg.adjust_dcp_kv_cache_interleave_size(groups)
    assert pc.cp_kv_cache_interleave_size == 16


def test_try_verify_and_update_config_object_storage() -> None:
    from pagedllm.config import LoadConfig
    from pagedllm.config.support import allow_unsupported

    with allow_unsupported():
        cfg = EngineConfig(model_config=ModelConfig(model_weights="s3://bucket/model"))
        assert cfg.load_config.load_format == "runai_streamer"
        with pytest.raises(ValueError, match="load_format='safetensors' cannot load object-storage weights"):
            EngineConfig(
                model_config=ModelConfig(model_weights="s3://bucket/model"),
                load_config=LoadConfig(load_format="safetensors"),
            )
    # The model hooks run once per model config: a second pass leaves a changed format alone.
    cfg.load_config.load_format = "auto"
    cfg.try_verify_and_update_config()
    assert cfg.load_config.load_format == "auto" and cfg.model_config.config_updated
    # Without the gate, object-storage weights are refused as unsupported.
    with pytest.raises(ValueError, match="model_config.model_weights"):
        EngineConfig(model_config=ModelConfig(model_weights="s3://bucket/model"))


def test_breakable_cudagraph_env_keeps_piecewise_without_compilation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedllm.config import CompilationMode, CUDAGraphMode, default_breakable_cudagraph_architectures

    assert default_breakable_cudagraph_architectures() == frozenset()
    monkeypatch.setenv("PAGEDLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    cc = build_cuda().compilation_config
    # P29: breakable graphs switch compilation off; P41/P50 then keep the piecewise part.
    assert cc.mode == CompilationMode.NONE and cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


def test_breakable_cudagraph_default_decided_without_writing_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reference writes the variable back (and NCCL_GRAPH_REGISTER); pagedllm's construction keeps
    the decision in the config and leaves os.environ as it found it."""
    from pagedllm.config import CompilationMode
    from pagedllm.platforms.cuda import CudaPlatform

    monkeypatch.delenv("PAGEDLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    monkeypatch.setattr(
        CudaPlatform,
        "default_breakable_cudagraph_architectures",
        lambda self: frozenset({"LlamaForCausalLM"}),
    )
    before = dict(os.environ)
    cc = build_cuda().compilation_config
    assert dict(os.environ) == before
    assert cc.mode == CompilationMode.NONE


def test_rocm_only_fusion_predicates_are_off() -> None:
    from pagedllm.config import (
        enable_mla_dual_rms_norm_fusion,
        enable_norm_pad_fusion,
        enable_qk_norm_rope_kvcache,
        enable_rope_kvcache_fusion,
    )

    cfg = build_cuda(compilation={"custom_ops": ["all"]})
    # AITER (ROCm) is never available, so these stay off even with every custom op on.
    for predicate in (
        enable_rope_kvcache_fusion,
        enable_mla_dual_rms_norm_fusion,
        enable_qk_norm_rope_kvcache,
    ):
        assert predicate(cfg) is False
    assert enable_norm_pad_fusion(cfg) is False
    cfg.kernel_config.ir_op_priority.fused_add_rms_norm = ["aiter"]
    cfg.model_config.hf_text_config.hidden_size = 2880
    assert enable_norm_pad_fusion(cfg) is True


def test_level_table_must_set_flashinfer_autotune(monkeypatch: pytest.MonkeyPatch) -> None:
    # P37: a level table that leaves kernel_config.enable_flashinfer_autotune unset is a bug, caught at
    # construction rather than by a kernel reading None later.
    table = {level: dict(value) for level, value in OPTIMIZATION_LEVEL_TO_CONFIG.items()}
    del table[2]["kernel_config"]
    monkeypatch.setattr("pagedllm.config.construction.OPTIMIZATION_LEVEL_TO_CONFIG", table)
    with pytest.raises(ValueError, match="enable_flashinfer_autotune must be set"):
        EngineConfig()
    assert EngineConfig(optimization_level=1).kernel_config.enable_flashinfer_autotune is True
