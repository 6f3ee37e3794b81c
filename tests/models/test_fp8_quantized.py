"""`quantization="fp8"`: an unquantized checkpoint's linear layers stored as e4m3 with per-output-channel
scales at load. Exact against HF transformers on the same fp8-rounded weights (greedy tokens and
log-probabilities up to summation order) and bounded against the bfloat16 model; no float copy kept;
fp8 checkpoints are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from test_gguf_quantized import assert_greedy_like_hf
from tiny_llm import make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.layers.quant.fp8 import Fp8OnlineLinearMethod, quantize_rows
from pagedllm.models import get_model

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
    assert config.quant_config is not None and config.quant_config.name == "fp8"
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


def test_fp8_checkpoints_are_refused(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'fp8', which is not supported"):
        ModelConfig(model=str(out), quantization="fp8")
