"""AWQ and GPTQ checkpoints run from their packed 4-bit weights: a tiny Llama whose linear layers are
random 4-bit weights packed in the test as AutoAWQ / AutoGPTQ write them (int4_checkpoints.py), loaded
by the engine's loader from its config (quantization detected from config.json), generates 16 greedy
tokens equal to HF transformers' on the dequantized float weights, with bounded log-probabilities; the
weights stay packed; bad checkpoints fail at load naming file and tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from int4_checkpoints import quantize_checkpoint
from safetensors.torch import load_file, save_file
from test_gguf_quantized import assert_greedy_like_hf
from tiny_llm import make_tiny_llm

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.layers.quant.int4 import Int4LinearMethod
from pagedllm.models import ModelLoadError, get_model
from pagedllm.models.loader.quantization import resolve_quant_config

# Per-token log-probability difference allowed against HF on the dequantized weights. Both run in
# float32 on the same weight values (the kernel dequantizes s * (q - z) exactly as the reference does,
# up to one rounding of s * z): only the summation order differs, ~1e-6 relative per product, measured
# at most 2e-5 nats here. A nibble, zero or scale read from the wrong place changes weights by whole
# quantization steps and log-probabilities by 0.1 nats or more.
LOGPROB_BOUND = 1e-3
# Widths that groups of 32 and 128 both tile (head_dim given: LlamaConfig would keep the default's).
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
CASES = [
    ("awq", 32, False),
    ("awq", 128, False),
    ("gptq", 32, False),
    ("gptq", 128, False),
    ("gptq", 32, True),
    ("gptq", 128, True),
]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("float"), **SHAPE)


@pytest.mark.parametrize(("fmt", "group", "act_order"), CASES)
def test_engine_matches_hf_on_dequantized_weights(
    float_dir: Path, tmp_path: Path, fmt: str, group: int, act_order: bool
) -> None:
    hf = quantize_checkpoint(float_dir, tmp_path, fmt, group, act_order, seed=3)
    engine_config = EngineConfig(model_config=ModelConfig(model=str(tmp_path), dtype="float32"))
    quant = resolve_quant_config(engine_config.model_config)
    assert (
        quant is not None and quant.name == fmt and quant.group_size == group and quant.desc_act == act_order
    )
    model = get_model(engine_config)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down.quant_method, Int4LinearMethod)
    assert (down.int4_perm is not None) == act_order
    prompt = torch.randint(
        0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    # 20 tokens: the prompt runs the dequantized-tile path, each decode step the native kernel.
    assert_greedy_like_hf(model, hf, prompt, LOGPROB_BOUND)


def test_weights_stay_packed(float_dir: Path, tmp_path: Path) -> None:
    """No float copy of a quantized weight: only the embedding / LM head and norms are float, and the
    4-bit layers hold about the checkpoint's packed bytes."""
    quantize_checkpoint(float_dir, tmp_path, "gptq", 32, act_order=True)
    model = get_model(EngineConfig(model_config=ModelConfig(model=str(tmp_path), dtype="float32")))
    float_matrices = {n for n, p in model.named_parameters() if p.is_floating_point() and p.dim() > 1}
    assert float_matrices <= {"model.embed_tokens.weight", "lm_head.weight"}
    packed = {n: t for n, t in load_file(tmp_path / "model.safetensors").items() if t.dtype != torch.float32}
    checkpoint_bytes = sum(t.numel() * t.element_size() for n, t in packed.items() if not n.endswith("g_idx"))
    resident = sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.split(".")[-1].startswith("int4_")
    )
    resident -= sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("int4_perm"))
    assert abs(resident / checkpoint_bytes - 1) < 0.1, (resident, checkpoint_bytes)


def test_group_not_dividing_the_width_is_refused_naming_file_and_tensor(tmp_path: Path) -> None:
    float_dir = make_tiny_llm(tmp_path / "float", **{**SHAPE, "intermediate_size": 160})
    out = tmp_path / "awq"
    out.mkdir()
    quantize_checkpoint(float_dir, out, "awq", 32)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # 160-wide down_proj: not whole groups
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.qweight': group_size 64 does "
        r"not divide its input width 160",
    ):
        get_model(EngineConfig(model_config=ModelConfig(model=str(out), dtype="float32")))


def test_missing_tensor_is_refused_naming_file_and_tensor(float_dir: Path, tmp_path: Path) -> None:
    quantize_checkpoint(float_dir, tmp_path, "gptq", 128)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.scales"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.k_proj\.scales' is missing",
    ):
        get_model(EngineConfig(model_config=ModelConfig(model=str(tmp_path), dtype="float32")))


def test_llm_greedy_matches_hf_generate(float_dir: Path, tmp_path: Path) -> None:
    """The whole engine (scheduler, batched prompts, decode steps) on an act-order GPTQ checkpoint."""
    from pagedllm import LLM, SamplingParams

    hf = quantize_checkpoint(float_dir, tmp_path, "gptq", 32, act_order=True, seed=3)
    llm = LLM(
        model=str(tmp_path), dtype="float32", max_model_len=256, enforce_eager=True, optimization_level=0
    )
    prompts = ["Hello, world!", "Paged attention stores keys", "0 1 2 3"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer.encode(prompt)
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        assert output.outputs[0].token_ids == expected.tolist()
