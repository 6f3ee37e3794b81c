"""OLMo 2 and Granite GGUF files, written from a tiny random HF model as llama.cpp's converter writes
them (its tensor names, q/k rows permuted for Granite, the multipliers as metadata): the config read
back and the model loaded from the file give the HF model's logits over the paged cache. transformers
cannot read these two GGUF architectures, so the file is built here from its layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from attention.paged_batch import PagedBatch
from dense_families import VOCAB, make_family_model
from gemma_gguf_files import finish_gguf
from gguf import GGUFWriter
from transformers import PreTrainedModel

from pagedllm.formats.gguf_metadata import hf_config_from_gguf, read_gguf_header
from pagedllm.models import load_model

# llama.cpp's names of the HF modules (per block, then top level).
_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": {"olmo2": "post_attention_norm", "granite": "ffn_norm", "phi3": "ffn_norm"},
    "post_feedforward_layernorm": "post_ffw_norm",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str, arch: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{suffix}"
    _, _, index, rest = module.split(".", 3)
    name = _BLOCK_NAMES[rest]
    return f"blk.{index}.{name[arch] if isinstance(name, dict) else name}.{suffix}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter: HF's half-split rotary rows to its interleaved layout.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(hf: PreTrainedModel, path: Path, arch: str, extra: dict[str, np.ndarray] | None = None) -> Path:
    """The GGUF file of `hf`, plus the `extra` tensors."""
    c = hf.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if arch == "phi3":
        writer.add_sliding_window(c.sliding_window)
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    if arch == "granite":
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    for name, tensor in hf.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if arch == "granite" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        writer.add_tensor(_gguf_name(name, arch), w)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    return finish_gguf(writer, path)


@pytest.mark.parametrize("arch", ["granite", "olmo2", "phi3"])
def test_gguf_model_matches_hf(tmp_path: Path, arch: str) -> None:
    # Phi-3 without LongRoPE (a 4k model: llama.cpp stores LongRoPE factors as tensors, not read yet).
    overrides = (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
        if arch == "phi3"
        else {}
    )
    hf = make_family_model(arch, tmp_path / "hf", overrides=overrides)
    path = _write(hf, tmp_path / f"{arch}.gguf", arch)
    config = hf_config_from_gguf(read_gguf_header(path))
    assert config.architectures == [type(hf).__name__]
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        # GGUF stores them as float32; a family without the multiplier has it on neither side (pytest 9.2
        # refuses approx(None)).
        ours, theirs = getattr(config, key, None), getattr(hf.config, key, None)
        assert (ours is None) == (theirs is None), key
        assert theirs is None or ours == pytest.approx(theirs, rel=1e-6), key
    model = load_model(config, tmp_path, gguf_file=path.name)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = PagedBatch.for_model(model)
    got = torch.cat([*batch.run(model, [("r", ids[:30])]), *batch.run(model, [("r", ids[30:31])])])
    with torch.no_grad():
        expected = hf(torch.tensor([ids[:31]])).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_phi3_longrope_gguf_is_refused(tmp_path: Path) -> None:
    hf = make_family_model("phi3", tmp_path / "hf")
    path = _write(
        hf, tmp_path / "phi3.gguf", "phi3", extra={"rope_factors_long.weight": np.ones(8, np.float32)}
    )
    with pytest.raises(ValueError, match=r"LongRoPE factors \(rope_factors_long/short\) are not supported"):
        hf_config_from_gguf(read_gguf_header(path))
