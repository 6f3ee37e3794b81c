"""Weight loading: sharded safetensors, dummy weights, get_model from an EngineConfig, peak RSS, and
clear errors for bad input."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model
from torch import nn
from transformers import AutoConfig, LlamaConfig

from pagedllm.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedllm.layers.quant import LinearMethodBase, WeightLoader
from pagedllm.models import ModelLoadError, load_model, supported_architectures
from pagedllm.quant_interface import QuantizationConfig


def _llama_config(**overrides: object) -> LlamaConfig:
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        architectures=["LlamaForCausalLM"],
    )
    base.update(overrides)
    return LlamaConfig(**base)


def _random_checkpoint(config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def _save_sharded(
    tensors: dict[str, torch.Tensor], path: Path, config: LlamaConfig, num_shards: int = 2
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    names = list(tensors)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[s::num_shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_safetensors_fold_into_fused_weights(tmp_path: Path) -> None:
    config = _llama_config()
    tensors = _random_checkpoint(config, torch.bfloat16)
    _save_sharded(tensors, tmp_path, config, num_shards=3)
    model = load_model(config, tmp_path, dtype=torch.float32)
    attn = model.model.layers[1].self_attn
    expected_qkv = torch.cat([tensors[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]).float()
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    mlp = model.model.layers[0].mlp
    expected_gate_up = torch.cat(
        [tensors[f"model.layers.0.mlp.{x}_proj.weight"] for x in ("gate", "up")]
    ).float()
    assert torch.equal(mlp.gate_up_proj.weight, expected_gate_up)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].float())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bfloat16_model(tmp_path: Path) -> None:
    config = _llama_config()
    tensors = _random_checkpoint(config)
    _save_sharded(tensors, tmp_path, config, num_shards=1)
    model = load_model(config, tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"].bfloat16())


def test_dummy_weights_read_no_files() -> None:
    config = _llama_config(tie_word_embeddings=True)
    a = load_model(config, "/nonexistent/dir", load_format="dummy", seed=3)
    b = load_model(config, "/nonexistent/dir", load_format="dummy", seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        assert pa.abs().max() <= 1e-3 and pa.abs().max() > 0
    assert a.lm_head.weight is a.model.embed_tokens.weight


def test_get_model_from_engine_config(tmp_path: Path) -> None:
    from pagedllm.config import EngineConfig, ModelConfig
    from pagedllm.models import get_model

    hf = make_tiny_model("qwen2-bias", tmp_path)
    engine_config = EngineConfig(model_config=ModelConfig(model=str(tmp_path), dtype="float32"))
    model = get_model(engine_config)
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.training
    sd = hf.state_dict()
    assert torch.equal(
        model.model.layers[0].self_attn.qkv_proj.bias[: hf.config.hidden_size],
        sd["model.layers.0.self_attn.q_proj.bias"],
    )


def test_get_model_downloads_hub_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub repo id: config construction fetches metadata only, get_model then fetches exactly the
    indexed shards, with the same revision and download dir (snapshot_download faked: no network)."""
    from pagedllm.config import EngineConfig, ModelConfig
    from pagedllm.models import get_model

    config = _llama_config()
    tensors = _random_checkpoint(config)
    repo = tmp_path / "repo"
    _save_sharded(tensors, repo, config, num_shards=2)
    (repo / "consolidated.safetensors").write_bytes(b"never fetched")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    calls: list[dict[str, object]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        patterns = kwargs["allow_patterns"]
        assert isinstance(patterns, list)
        for file in repo.iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in patterns):
                shutil.copy(file, snapshot / file.name)
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model_config = ModelConfig(
        model="someorg/tiny", revision="v1", download_dir=str(tmp_path / "dl"), dtype="float32"
    )
    assert len(calls) == 1 and not list(snapshot.glob("*.safetensors"))
    model = get_model(EngineConfig(model_config=model_config))
    assert len(calls) == 2
    weights_call = calls[1]
    assert weights_call["repo_id"] == "someorg/tiny" and weights_call["revision"] == "v1"
    assert weights_call["cache_dir"] == str(tmp_path / "dl")
    assert weights_call["allow_patterns"] == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert weights_call["ignore_patterns"] == ["original/**/*"]
    assert not (snapshot / "consolidated.safetensors").exists()
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])


def test_load_format_without_matching_files(tmp_path: Path) -> None:
    config = _llama_config()
    _save_sharded(_random_checkpoint(config), tmp_path, config, num_shards=1)
    with pytest.raises(ModelLoadError, match="load_format='gguf' but .* has no .gguf file"):
        load_model(config, tmp_path, load_format="gguf")


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil
    from transformers import AutoConfig, LlamaConfig
    from pagedllm.models import load_model
    path = sys.argv[1]
    config = AutoConfig.from_pretrained(path)
    # Warm up with a tiny dummy model first: torch's one-time runtime initialization (~100 MB of
    # thread pools and kernels) is not memory the loader uses.
    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       vocab_size=256, architectures=["LlamaForCausalLM"])
    load_model(tiny, path, load_format="dummy")
    before = psutil.Process().memory_info().rss
    model = load_model(config, path)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec (pytest's size).
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    peak = int(status["VmHWM"].split()[0]) * 1024
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"before": before, "peak": peak, "size": size}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_rss_while_loading_stays_under_1_5x_model_size(tmp_path: Path) -> None:
    # ~118 MB of float32 weights in two shards, same dtype as the model: without releasing the mapped
    # pages the checkpoint and the parameters would both be resident (2x).
    config = _llama_config(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=16384,
    )
    _save_sharded(_random_checkpoint(config), tmp_path, config, num_shards=2)
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True, check=True
    )
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["size"] > 100e6
    growth = stats["peak"] - stats["before"]
    assert growth < 1.5 * stats["size"], stats


# --- bad input: one exception type, one message ----------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(_llama_config(), tmp_path / "absent")


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights .*pytorch_model.bin"):
        load_model(_llama_config(), tmp_path)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x01\x02",  # shorter than the length prefix
        (10**12).to_bytes(8, "little") + b"{}",  # header length beyond the file
        (9).to_bytes(8, "little") + b"not json!",
        (2).to_bytes(8, "little") + b"[]",
        (70).to_bytes(8, "little")
        + b'{"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}'.ljust(70),
        (60).to_bytes(8, "little")
        + b'{"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}'.ljust(60)
        + b"\0" * 4,
    ],
    ids=["truncated", "length", "json", "not-object", "offsets", "dtype"],
)
def test_corrupt_safetensors_header(tmp_path: Path, payload: bytes) -> None:
    (tmp_path / "model.safetensors").write_bytes(payload)
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        load_model(_llama_config(), tmp_path)


def test_missing_and_unknown_weights(tmp_path: Path) -> None:
    config = _llama_config()
    tensors = _random_checkpoint(config)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    _save_sharded(tensors, tmp_path / "missing", config, num_shards=1)
    with pytest.raises(
        ModelLoadError, match=r"missing weights for: model.layers.1.self_attn.qkv_proj.weight"
    ):
        load_model(config, tmp_path / "missing")
    tensors = _random_checkpoint(config) | {"model.extra.weight": torch.zeros(2)}
    _save_sharded(tensors, tmp_path / "extra", config, num_shards=1)
    with pytest.raises(ModelLoadError, match="'model.extra.weight' has no matching parameter"):
        load_model(config, tmp_path / "extra")


def test_shape_mismatch(tmp_path: Path) -> None:
    config = _llama_config()
    tensors = _random_checkpoint(config) | {"model.norm.weight": torch.ones(3)}
    _save_sharded(tensors, tmp_path, config, num_shards=1)
    # The checkpoint and the tensor are named.
    with pytest.raises(
        ModelLoadError, match=rf"^{tmp_path}: checkpoint tensor 'model.norm.weight' of shape \(3,\)"
    ):
        load_model(config, tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError,
        match="GPT2LMHeadModel.*not supported; supported: " + ", ".join(supported_architectures()),
    ):
        load_model(AutoConfig.for_model("gpt2", architectures=["GPT2LMHeadModel"]), tmp_path)


def test_unsupported_options(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="load_format='pt' is not supported"):
        load_model(_llama_config(), tmp_path, load_format="pt")
    with pytest.raises(
        NotImplementedError, match="tensor_parallel_size=2, but this process.s tensor-parallel group has 1"
    ):
        load_model(_llama_config(), tmp_path, load_format="dummy", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rope_scaling type 'mrope' is not supported"):
        load_model(
            _llama_config(rope_scaling={"rope_type": "mrope", "factor": 2.0}), tmp_path, load_format="dummy"
        )
    with pytest.raises(ValueError, match="hidden_act='relu' is not supported"):
        load_model(_llama_config(hidden_act="relu"), tmp_path, load_format="dummy")


def test_loaded_checkpoint_matches_file_after_mapping_closed(tmp_path: Path) -> None:
    """Parameters own their memory: reading them after the files were rewritten gives the old values."""
    config = _llama_config()
    _save_sharded(_random_checkpoint(config), tmp_path, config, num_shards=1)
    model = load_model(config, tmp_path)
    original = {k: v.clone() for k, v in load_file(str(next(tmp_path.glob("*.safetensors")))).items()}
    for f in tmp_path.glob("*.safetensors"):
        f.write_bytes(b"\0" * f.stat().st_size)
    assert torch.equal(model.model.embed_tokens.weight, original["model.embed_tokens.weight"])


class _ZeroingMethod(LinearMethodBase):
    """Weights as an unquantized layer keeps them; records what the loader calls; the product times 0."""

    def __init__(self, config: _RecordingConfig) -> None:
        self.config = config
        self.dense = UnquantizedLinearMethod()

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        self.dense.create_weights(
            layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.config.processed.append(layer.prefix)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.config.applied.add(layer.prefix)
        return self.dense.apply(layer, x, bias) * 0


class _RecordingConfig(QuantizationConfig):
    name = "recording"

    def __init__(self) -> None:
        self.chosen: list[str] = []
        self.processed: list[str] = []
        self.applied: set[str] = set()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> _ZeroingMethod | None:
        if not isinstance(layer, LinearBase):
            return None
        self.chosen.append(prefix)
        return _ZeroingMethod(self)


def test_quantization_config_chooses_every_linear_layers_method(tmp_path: Path) -> None:
    """Every linear layer asks the config for its method by its own name, loads its checkpoint tensors
    through it, has it finish them after loading, and computes its product with it (here: zeros, so
    each token's hidden state is the final norm of its embedding)."""
    config = _llama_config()
    tensors = _random_checkpoint(config)
    _save_sharded(tensors, tmp_path, config, num_shards=1)
    quant = _RecordingConfig()
    model = load_model(config, tmp_path, quant_config=quant)
    linears = [name for name, m in model.named_modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * config.num_hidden_layers
    assert quant.chosen == linears and quant.processed == linears
    fused = torch.cat([tensors[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj.weight.data, fused, atol=0, rtol=0)

    ids = [3, 17, 200, 5]
    with torch.no_grad():
        (logits,) = PagedBatch.for_model(model).run(model, [("r", ids)])
        want = model.compute_logits(model.model.norm(model.model.embed_tokens(torch.tensor(ids))))
    assert quant.applied == set(linears)
    torch.testing.assert_close(logits, want)


_CASTS = ("half", "float", "double", "bfloat16", "type")


def test_loading_never_casts_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters are created in the target dtype: no `Module.to(dtype)` (or `.half()`...) runs while
    loading, which would also convert a quantization method's storage."""
    calls: list[str] = []
    original_to = nn.Module.to

    def recording_to(self: nn.Module, *args: object, **kwargs: object) -> nn.Module:
        if "dtype" in kwargs or any(isinstance(a, torch.dtype | torch.Tensor) for a in args):
            calls.append(f"{type(self).__name__}.to{args}{kwargs}")
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", recording_to)
    for name in _CASTS:
        original = getattr(nn.Module, name)
        monkeypatch.setattr(
            nn.Module, name, lambda self, *a, _n=name, _o=original: calls.append(_n) or _o(self, *a)
        )
    config = _llama_config(tie_word_embeddings=True)
    tensors = _random_checkpoint(config)
    _save_sharded(tensors, tmp_path, config, num_shards=1)
    model = load_model(config, tmp_path, dtype=torch.bfloat16)
    assert calls == []
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(
        model.model.embed_tokens.weight.data, tensors["model.embed_tokens.weight"].bfloat16(), atol=0, rtol=0
    )
