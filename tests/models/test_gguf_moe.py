"""Mixture-of-experts GGUF files (llama.cpp layout: stacked `ffn_*_exps` experts, `ffn_gate_inp`
router, `ffn_*_shexp` shared expert): the config read from the header, every expert equal to
transformers' GGUF reader, and the model's logits equal to the HF model the file was converted from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_moe_gguf_from_hf
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.formats.gguf_metadata import hf_config_from_gguf, read_gguf_header
from pagedllm.models import load_model
from pagedllm.models.loader.gguf_loader import iterate_gguf

# variant -> (GGUF arch, config overrides: llama.cpp has no key for dense layers among sparse ones).
FILES = {
    "qwen3moe-top4-norm": ("qwen3moe", {"mlp_only_layers": []}),
    "qwen2moe-top2-shared": ("qwen2moe", {}),
    "mixtral-top3": ("llama", {}),
}
CONFIG_FIELDS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "intermediate_size",
)


@pytest.mark.parametrize("variant", sorted(FILES))
def test_moe_gguf_matches_the_hf_model(tmp_path: Path, variant: str) -> None:
    arch, overrides = FILES[variant]
    hf = make_tiny_model(variant, tmp_path / "hf", **overrides)
    path = write_moe_gguf_from_hf(hf, tmp_path / f"{variant}.gguf", arch)
    config = hf_config_from_gguf(read_gguf_header(path))
    assert config.architectures == hf.config.architectures
    for field in CONFIG_FIELDS:
        assert getattr(config, field, None) == getattr(hf.config, field, None), field
    ours = load_model(config, tmp_path, gguf_file=path.name)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = PagedBatch.for_model(ours)
    (prefill,) = batch.run(ours, [("r", ids[:39])])
    (decode,) = batch.run(ours, [("r", ids[39:])])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat([prefill, decode]), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("variant", "arch"), [("qwen3moe-top4-norm", "qwen3moe"), ("qwen2moe-top2-shared", "qwen2moe")]
)
def test_quantized_experts_equal_transformers(tmp_path: Path, variant: str, arch: str) -> None:
    """Q8_0 / Q4_0 / F16 stacked experts dequantize, expert by expert, to transformers' GGUF tensors
    (the down projections' rows, 48 wide, are not a whole number of quantization blocks)."""
    hf = make_tiny_model(variant, tmp_path / "hf", mlp_only_layers=[])
    types = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.F16, "ffn_gate_inp": Q.F16}
    path = write_moe_gguf_from_hf(hf, tmp_path / "q.gguf", arch, tensor_types=types)
    config = hf_config_from_gguf(read_gguf_header(path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(iterate_gguf(path))
    inter = config.moe_intermediate_size
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp."
        gate_up, down = reference[f"{prefix}experts.gate_up_proj"], reference[f"{prefix}experts.down_proj"]
        for e in range(config.num_experts):
            assert torch.equal(ours[f"{prefix}experts.{e}.gate_proj.weight"], gate_up[e, :inter])
            assert torch.equal(ours[f"{prefix}experts.{e}.up_proj.weight"], gate_up[e, inter:])
            assert torch.equal(ours[f"{prefix}experts.{e}.down_proj.weight"], down[e])
        assert torch.equal(ours[f"{prefix}gate.weight"], reference[f"{prefix}gate.weight"].float())
        if arch == "qwen2moe":
            gate = reference[f"{prefix}shared_expert_gate.weight"]
            assert torch.equal(ours[f"{prefix}shared_expert_gate.weight"], torch.as_tensor(gate).float())
    # The dequantized experts also load into the model.
    load_model(config, tmp_path, gguf_file=path.name)
