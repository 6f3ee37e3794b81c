"""`quantization="fp8"`: an unquantized checkpoint's linear layers stored as e4m3 with per-output-channel
scales at load, and fp8 checkpoints (e4m3 weights + `weight_scale`, written in the test). Exact against
HF transformers on the same fp8-rounded / dequantized weights (greedy tokens and log-probabilities up to
summation order) and bounded against the bfloat16 model; no float copy kept; bad checkpoints refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from safetensors.torch import load_file, save_file
from test_gguf_quantized import assert_greedy_like_hf
from tiny_llm import make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.layers.quant.fp8 import (
    FP8,
    FP8_MAX,
    Fp8CheckpointLinearMethod,
    Fp8OnlineLinearMethod,
    quantize_rows,
)
from pagedllm.models import get_model
from pagedllm.models.loader import ModelLoadError
from pagedllm.models.loader.quantization import resolve_quant_config

# Against HF on the fp8-rounded weights, both float32: summation order only (measured 4e-6).
EXACT_BOUND = 1e-3
# Against the bfloat16 model, on the same 48 tokens: e4m3 keeps 3 mantissa bits (each weight moves by
# up to 1/16 of itself), which these tiny random models (peaked logits of magnitude 5-10) turn into
# mean log-probability differences of the reference's top token of 0.08-0.14 nats and at most 0.5
# (measured over 6 seeds); a scale read wrongly moves them by whole nats.
MEAN_BOUND, MAX_BOUND = 0.25, 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("float"))


def _fp8_model(model_dir: Path, dtype: str) -> torch.nn.Module:
    config = EngineConfig(model_config=ModelConfig(model=str(model_dir), dtype=dtype, quantization="fp8"))
    quant = resolve_quant_config(config.model_config)
    assert quant is not None and quant.name == "fp8"
    return get_model(config)


def test_matches_hf_on_fp8_rounded_weights(model_dir: Path) -> None:
    model = _fp8_model(model_dir, "float32")
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method, Fp8OnlineLinearMethod)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = hf.state_dict()
    for name, weight in state.items():
        if name.endswith("_proj.weight"):
            q, scale = quantize_rows(weight)
            state[name] = q.float() * scale[:, None]
    hf.load_state_dict(state)
    prompt = torch.randint(
        0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    assert_greedy_like_hf(model, hf, prompt, EXACT_BOUND)


def test_bounded_against_the_bfloat16_model(model_dir: Path) -> None:
    model = _fp8_model(model_dir, "bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, hf.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = PagedBatch.for_model(model, num_blocks=16, dtype=torch.bfloat16)
    (logits,) = batch.run(model, [("r", ids)])
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    top = reference.argmax(-1, keepdim=True)
    diff = (torch.log_softmax(logits.float(), -1).gather(1, top) - reference.gather(1, top)).abs()
    assert diff.mean() < MEAN_BOUND and diff.max() < MAX_BOUND, (diff.mean(), diff.max())


def test_no_float_copy_of_the_linear_weights(model_dir: Path) -> None:
    model = _fp8_model(model_dir, "bfloat16")
    float_matrices = {n for n, p in model.named_parameters() if p.dim() > 1}
    assert float_matrices <= {"model.embed_tokens.weight", "lm_head.weight"}
    down = model.model.layers[0].mlp.down_proj
    assert down.fp8_weight.dtype == torch.float8_e4m3fn and down.fp8_scale.shape == (down.output_size,)


def _write_fp8_checkpoint(
    model_dir: Path, out: Path, per_channel: bool, static: bool
) -> dict[str, torch.Tensor]:
    """`model_dir` rewritten as an fp8 checkpoint in `out` (e4m3 linear weights with their
    `weight_scale`, per tensor or per output channel; with `static`, an `input_scale` per layer too);
    returns the dequantized state dict (fp8 * scale) HF runs as the reference."""
    shutil.copytree(model_dir, out)
    state = load_file(out / "model.safetensors")
    stored, dequantized = {}, {}
    for name, weight in state.items():
        if not name.endswith("_proj.weight"):
            stored[name] = dequantized[name] = weight
            continue
        if "k_proj" in name or "up_proj" in name:
            weight = weight * 4  # fused parts whose per-tensor scales differ from their neighbours'
        if per_channel:
            q, scale = quantize_rows(weight)
            scale = scale[:, None]
        else:
            scale = weight.abs().max() / FP8_MAX
            q = (weight / scale).to(FP8)
        stored[name], stored[f"{name}_scale"] = q, scale
        if static:
            stored[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
        dequantized[name] = q.float() * scale.reshape(-1, 1)
    save_file(stored, out / "model.safetensors")
    _set_quantization_config(
        out, {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    )
    return dequantized


def _set_quantization_config(path: Path, quant: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("per_channel", "static"), [(False, False), (True, False), (False, True)])
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(
    model_dir: Path, tmp_path: Path, per_channel: bool, static: bool
) -> None:
    reference = _write_fp8_checkpoint(model_dir, tmp_path / "fp8", per_channel, static)
    config = EngineConfig(model_config=ModelConfig(model=str(tmp_path / "fp8"), dtype="float32"))
    assert config.model_config.quantization == "fp8"
    assert resolve_quant_config(config.model_config).is_checkpoint_fp8_serialized
    model = get_model(config)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Fp8CheckpointLinearMethod)
    assert qkv.fp8_weight.dtype == FP8 and qkv.fp8_scale.shape == (qkv.output_size,)
    assert {n for n, p in model.named_parameters() if p.dim() > 1} <= {
        "model.embed_tokens.weight",
        "lm_head.weight",
    }
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.load_state_dict(reference)
    prompt = torch.randint(
        0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    assert_greedy_like_hf(model, hf, prompt, EXACT_BOUND)


def test_fp8_checkpoint_without_weight_scale_is_an_error(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    _write_fp8_checkpoint(model_dir, out, per_channel=True, static=False)
    stored = load_file(out / "model.safetensors")
    del stored["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(stored, out / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"model\.safetensors: fp8 tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        get_model(EngineConfig(model_config=ModelConfig(model=str(out))))
