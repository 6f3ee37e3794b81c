"""ModelConfig: model sources, the GGUF header reader against transformers' own, dtype and
max_model_len resolution, sampling defaults and token ids."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from config_testing import write_hf_dir

from pagedllm.config import ModelConfig, ParallelConfig
from pagedllm.formats.model_source import resolve_model_source
from pagedllm.platforms import override_platform


def test_default_model_is_embedded_gguf(smollm2_gguf: Path) -> None:
    for mc in (ModelConfig(), ModelConfig(model="SmolLM2-135M-Instruct")):
        assert mc.gguf_file == smollm2_gguf and mc.model_path == smollm2_gguf.parent
        assert mc.architecture == "LlamaForCausalLM" and mc.architectures == ["LlamaForCausalLM"]
        assert mc.max_model_len == 8192 and mc.quantization == "gguf"
        assert mc.served_model_name == "SmolLM2-135M-Instruct"
        assert mc.eos_token_ids == [2] and mc.bos_token_id == 1
        assert mc.chat_template is not None and "<|im_start|>" in mc.chat_template
    assert resolve_model_source(None).kind == "embedded"


def test_gguf_config_matches_transformers(smollm2_gguf: Path) -> None:
    from transformers import AutoConfig

    reference = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).to_dict()
    ours = ModelConfig(model=str(smollm2_gguf)).hf_config.to_dict()
    # Identity fields, not architecture: transformers leaves architectures unset and stores general.name
    # as `_model_name_or_path`; pagedllm names the architecture and keeps the name in _name_or_path.
    for key in ("architectures", "_name_or_path", "_model_name_or_path", "transformers_version"):
        reference.pop(key, None)
        ours.pop(key, None)
    assert ours == reference


def test_gguf_dir_and_file_sources(smollm2_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / smollm2_gguf.name).symlink_to(smollm2_gguf)
    mc = ModelConfig(model=str(tmp_path))
    assert mc.gguf_file == tmp_path / smollm2_gguf.name and mc.tokenizer == str(tmp_path / smollm2_gguf.name)
    (tmp_path / "second.gguf").symlink_to(smollm2_gguf)
    with pytest.raises(ValueError, match="several GGUF files"):
        ModelConfig(model=str(tmp_path))


def test_gguf_corrupt_and_unsupported(tmp_path: Path, smollm2_gguf: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(ValueError, match="not a GGUF file"):
        ModelConfig(model=str(bad))
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(smollm2_gguf.read_bytes()[:4096])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        ModelConfig(model=str(truncated))


def test_hf_directory(tiny_llama_dir: Path) -> None:
    mc = ModelConfig(model=str(tiny_llama_dir))
    assert mc.gguf_file is None and mc.model_path == tiny_llama_dir and mc.quantization is None
    assert mc.tokenizer == str(tiny_llama_dir)
    assert (mc.get_vocab_size(), mc.get_hidden_size(), mc.get_head_size()) == (256, 64, 16)
    assert (mc.get_total_num_layers(), mc.max_model_len) == (2, 512)
    pc = ParallelConfig(tensor_parallel_size=2)
    assert (mc.get_num_attention_heads(pc), mc.get_num_kv_heads(pc), mc.get_num_layers(pc)) == (2, 1, 2)
    assert mc.eos_token_ids == [2, 7] and mc.eos_token_id == 2
    assert mc.get_diff_sampling_param() == {"temperature": 0.6, "top_p": 0.9}
    over = ModelConfig(model=str(tiny_llama_dir), override_generation_config={"top_k": 5, "temperature": 1.0})
    assert over.get_diff_sampling_param() == {"temperature": 1.0, "top_k": 5, "top_p": 0.9}
    assert ModelConfig(model=str(tiny_llama_dir), generation_config="vllm").get_diff_sampling_param() == {}


def test_generation_config_path(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").unlink()
    assert ModelConfig(model=str(model_dir)).get_diff_sampling_param() == {}
    mc = ModelConfig(model=str(model_dir), generation_config=str(tiny_llama_dir))
    assert mc.get_diff_sampling_param() == {"temperature": 0.6, "top_p": 0.9}


def test_pipeline_layer_split(tmp_path: Path) -> None:
    mc = ModelConfig(model=write_hf_dir(tmp_path, num_hidden_layers=5))
    pc = ParallelConfig(pipeline_parallel_size=2)
    assert [mc.get_layers_start_end_indices(pc, r) for r in (0, 1)] == [(0, 3), (3, 5)]


def test_tp_must_divide_heads(tiny_llama_dir: Path) -> None:
    mc = ModelConfig(model=str(tiny_llama_dir))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\).*attention heads \(4\)"):
        mc.verify_with_parallel_config(ParallelConfig(tensor_parallel_size=3))


def test_max_model_len_too_large(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"max_model_len \(1024\).*\(512, from max_position_embeddings\)"):
        ModelConfig(model=str(tiny_llama_dir), max_model_len=1024)
    assert ModelConfig(model=str(tiny_llama_dir), max_model_len=128).max_model_len == 128
    monkeypatch.setenv("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert ModelConfig(model=str(tiny_llama_dir), max_model_len=1024).max_model_len == 1024


def test_dtype_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.platforms.cpu import CpuPlatform

    fp32 = write_hf_dir(tmp_path / "fp32", dtype="float32")
    fp16 = write_hf_dir(tmp_path / "fp16", dtype="float16")
    with override_platform("cpu"):
        monkeypatch.setattr(CpuPlatform, "has_native_bf16", staticmethod(lambda: False))
        assert ModelConfig(model=fp16).dtype == torch.float32
        monkeypatch.setattr(CpuPlatform, "has_native_bf16", staticmethod(lambda: True))
        assert ModelConfig(model=fp16).dtype == torch.bfloat16
        assert ModelConfig(model=fp16, dtype="bfloat16").dtype == torch.bfloat16
        assert ModelConfig(model=fp32, dtype=torch.float16).dtype == torch.float16
    with override_platform("cuda", capability=(9, 0)):
        assert ModelConfig(model=fp16).dtype == torch.float16
        assert ModelConfig(model=fp32).dtype == torch.bfloat16
    with override_platform("cuda", capability=(7, 5)):
        assert ModelConfig(model=fp32).dtype == torch.float16


def test_bad_dtype_names_field() -> None:
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float64")


def test_missing_local_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or directory"):
        ModelConfig(model=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a config.json nor a .gguf"):
        ModelConfig(model=str(tmp_path / "empty"))


def test_offline_hub_fails_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError, match=r"cannot fetch model 'someorg/some-model'.*HF_HUB_OFFLINE.*model=<path>"
    ):
        ModelConfig(model="someorg/some-model", download_dir=str(tmp_path))


def test_hf_overrides_and_untie(tmp_path: Path) -> None:
    path = Path(write_hf_dir(tmp_path, tie_word_embeddings=True))
    mc = ModelConfig(model=str(path), hf_overrides={"rms_norm_eps": 1e-3})
    assert mc.hf_config.rms_norm_eps == 1e-3
    from safetensors.torch import save_file

    save_file(
        {"lm_head.weight": torch.zeros(2, 2), "model.norm.weight": torch.zeros(2)}, path / "model.safetensors"
    )
    mc = ModelConfig(model=str(path))
    mc.maybe_untie_word_embeddings()
    assert mc.hf_text_config.tie_word_embeddings is False


def _write_gguf(path: Path, arch: str, name: str) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(1024)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(300)
    if arch == "llama":
        writer.add_rope_dimension_count(16)
    if arch == "qwen3":
        writer.add_key_length(32)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((300, 64), dtype=np.float32))
    writer.add_tensor("output.weight", np.zeros((300, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "name", "model_type", "architecture"),
    [
        ("qwen2", "tiny-qwen2", "qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "tiny-qwen3", "qwen3", "Qwen3ForCausalLM"),
        ("llama", "mistral", "mistral", "MistralForCausalLM"),
    ],
)
def test_gguf_other_architectures_match_transformers(
    tmp_path: Path, arch: str, name: str, model_type: str, architecture: str
) -> None:
    from transformers import AutoConfig

    path = _write_gguf(tmp_path / f"{arch}.gguf", arch, name)
    mc = ModelConfig(model=str(path))
    assert mc.model_type == model_type and mc.architecture == architecture
    assert mc.hf_text_config.tie_word_embeddings is False
    reference = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    ours = mc.hf_config.to_dict()
    for key in ("architectures", "_name_or_path", "_model_name_or_path", "transformers_version"):
        reference.pop(key, None)
        ours.pop(key, None)
    if arch == "qwen3":
        # transformers ignores qwen3.attention.key_length (it keeps Qwen3Config's default 128);
        # pagedllm reads the head size the file states.
        assert (ours.pop("head_dim"), reference.pop("head_dim")) == (32, 128)
    assert ours == reference


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "falcon.gguf", "falcon", "tiny-falcon")
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported; supported: llama"):
        ModelConfig(model=str(path))


def test_config_never_reads_weight_data(tmp_path: Path) -> None:
    """ModelConfig/EngineConfig read config.json and at most safetensors headers: a checkpoint whose
    tensor data is missing still configures (in milliseconds), and a corrupt header is left for the
    weight loader to report instead of failing construction with a JSON error."""
    import time

    from safetensors.torch import save_file

    from pagedllm.config import EngineConfig

    path = Path(write_hf_dir(tmp_path / "truncated", tie_word_embeddings=True))
    save_file(
        {"lm_head.weight": torch.zeros(256, 64), "model.norm.weight": torch.zeros(64)}, path / "m.safetensors"
    )
    data = (path / "m.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    (path / "m.safetensors").write_bytes(data[:header_end])  # header only, no tensor bytes
    ModelConfig(model=str(path))  # warm the transformers imports
    start = time.perf_counter()
    cfg = EngineConfig(model_config=ModelConfig(model=str(path)))
    assert time.perf_counter() - start < 0.5
    assert cfg.model_config.hf_text_config.tie_word_embeddings is False  # lm_head found in the header

    corrupt = Path(write_hf_dir(tmp_path / "corrupt", tie_word_embeddings=True))
    (corrupt / "model.safetensors").write_bytes((16).to_bytes(8, "little") + b"{not json!!!}xxx")
    cfg = EngineConfig(model_config=ModelConfig(model=str(corrupt)))
    assert cfg.model_config.hf_text_config.tie_word_embeddings is True
    (corrupt / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"\0" * 64)
    assert EngineConfig(model_config=ModelConfig(model=str(corrupt))).model_config is not None
