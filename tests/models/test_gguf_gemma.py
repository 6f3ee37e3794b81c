"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's layout): every tensor equals what transformers' GGUF
loader reads, and the model over the paged cache equals HF's model on those tensors (windows shorter
than the prompts, soft caps, Gemma 3's global layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from gemma_gguf_files import write_gemma_gguf
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.formats.gguf_metadata import hf_config_from_gguf, read_gguf_header
from pagedllm.models import load_model
from pagedllm.models.loader.gguf_loader import iterate_gguf

# arch -> (layers, HF architecture); Gemma 3's sixth layer is its first global one.
FILES = {"gemma2": (2, "Gemma2ForCausalLM"), "gemma3": (6, "Gemma3ForCausalLM")}


@pytest.mark.parametrize("arch", sorted(FILES))
def test_gemma_gguf_matches_hf(tmp_path: Path, arch: str) -> None:
    layers, hf_arch = FILES[arch]
    path = write_gemma_gguf(tmp_path / f"{arch}.gguf", arch, layers)
    config = hf_config_from_gguf(read_gguf_header(path))
    assert config.architectures == [hf_arch] and config.sliding_window == 8
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(iterate_gguf(path))
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), reference[name].float()), name

    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    model = load_model(config, tmp_path, gguf_file=path.name)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = PagedBatch.for_model(model)
    got = torch.cat([*batch.run(model, [("r", ids[:30])]), *batch.run(model, [("r", ids[30:31])])])
    with torch.no_grad():
        expected = hf(torch.tensor([ids[:31]])).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
