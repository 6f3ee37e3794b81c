"""GGUF loading: every tensor equals transformers' GGUF loader, SmolLM2 greedy tokens equal HF's on
the same dequantized weights, and clear errors for unsupported files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_llama_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.config.gguf_metadata import hf_config_from_gguf, read_gguf_header
from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.loader.gguf_loader import iterate_gguf

ALL_TYPES = {
    "token_embd": Q.F16,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q5_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.BF16,
}
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three colors.",
]


def _transformers_tensors(path: Path) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    config = hf_config_from_gguf(read_gguf_header(path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return config, load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]


def _assert_same_tensors(path: Path, reference: dict[str, torch.Tensor]) -> None:
    ours = dict(iterate_gguf(path))
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), reference[name].float()), name


def test_every_listed_type_equals_transformers(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", ALL_TYPES)
    _, reference = _transformers_tensors(path)
    _assert_same_tensors(path, reference)


def test_tiny_gguf_model_matches_hf(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "ffn_up": Q.Q4_1})
    config, reference = _transformers_tensors(path)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.load_state_dict(reference)
    ours = load_model(config, tmp_path, gguf_file=path.name)
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    (got,) = PagedBatch.for_model(ours).run(ours, [("r", ids)])
    with torch.no_grad():
        torch.testing.assert_close(got, hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf: Path) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    return _transformers_tensors(smollm2_gguf)


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers(smollm2_gguf: Path, smollm2_reference: tuple) -> None:
    _assert_same_tensors(smollm2_gguf, smollm2_reference[1])


def _greedy_paged(model: torch.nn.Module, prompts: list[list[int]], steps: int, eos: int) -> list[list[int]]:
    """All prompts prefilled in one step, then batched decode steps over the paged cache."""
    batch = PagedBatch.for_model(model, num_blocks=64)
    outs = [[] for _ in prompts]
    logits = batch.run(model, [(str(i), p) for i, p in enumerate(prompts)])
    live = list(range(len(prompts)))
    for _ in range(steps):
        for i, lg in zip(live, logits):
            outs[i].append(int(lg[-1].argmax()))
        live = [i for i in live if outs[i][-1] != eos and len(outs[i]) < steps]
        if not live:
            break
        logits = batch.run(model, [(str(i), [outs[i][-1]]) for i in live])
    return outs


@pytest.fixture
def one_thread() -> Iterator[None]:
    # On the shared 2-core machine, intra-op threads spin-wait behind other processes' work and run
    # several times slower than one thread (HF and ours both run under it).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_gguf: Path, smollm2_reference: tuple, one_thread: None) -> None:
    config, tensors = smollm2_reference
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(tensors, strict=False)
    hf.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        for p in PROMPTS
    ]
    eos = int(config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0])
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )
            expected.append(out[0, len(ids) :].tolist())
    ours = load_model(config, smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert _greedy_paged(ours, prompts, 32, eos) == expected


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "gpt2.gguf", {}, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2' is not supported; supported: llama"):
        next(iterate_gguf(path))


def test_unsupported_tensor_type_is_a_clear_error(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "q5.gguf", {"ffn_up": Q.Q5_0})
    config = hf_config_from_gguf(read_gguf_header(path))
    with pytest.raises(ModelLoadError, match=r"ffn_up.weight' has type Q5_0, which is not supported"):
        load_model(config, tmp_path, gguf_file=path.name)


def test_missing_or_corrupt_gguf_is_a_clear_error(tmp_path: Path) -> None:
    config = hf_config_from_gguf(read_gguf_header(write_llama_gguf(tmp_path / "ok.gguf", {})))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(config, tmp_path, gguf_file="absent.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(config, tmp_path, gguf_file="bad.gguf")
