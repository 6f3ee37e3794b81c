"""GGUF loading: every tensor equals transformers' GGUF loader, SmolLM2 greedy tokens equal HF's on
the same dequantized weights, and clear errors for unsupported files."""

from __future__ import annotations

import copy
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from gguf import GGMLQuantizationType as Q
from gguf_files import llama_cpp_rope_freqs, write_llama_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.formats.gguf_metadata import hf_config_from_gguf, read_gguf_header
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
    skeleton_config = config
    if config.model_type == "mistral":
        # transformers maps tensor names through gguf-py's arch of the skeleton's model_type, which
        # has no "mistral" (llama.cpp writes Mistral as "llama"); the names are Llama's.
        options = {k: v for k, v in config.to_diff_dict().items() if k != "model_type"}
        skeleton_config = LlamaConfig(**options)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(skeleton_config)
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


# (GGUF arch, general.name, extra writer options) -> the HF architecture it must load as.
ARCH_FILES = {
    "qwen2": ("qwen2", "tiny-test", {}, "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "tiny-test", {"head_dim": 32}, "Qwen3ForCausalLM"),
    # llama.cpp writes Mistral models as "llama"; transformers and pagedllm recognize them by name.
    "mistral": ("llama", "Mistral-tiny-test", {}, "MistralForCausalLM"),
}


@pytest.mark.parametrize("variant", sorted(ARCH_FILES))
def test_other_architectures_equal_transformers(tmp_path: Path, variant: str) -> None:
    arch, name, options, hf_arch = ARCH_FILES[variant]
    path = write_llama_gguf(tmp_path / f"{variant}.gguf", {"attn_q": Q.Q8_0}, arch=arch, name=name, **options)
    config, reference = _transformers_tensors(path)
    assert config.architectures == [hf_arch]
    _assert_same_tensors(path, reference)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert type(hf).__name__ == hf_arch
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    ours = load_model(config, tmp_path, gguf_file=path.name)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (got,) = PagedBatch.for_model(ours).run(ours, [("r", ids)])
    with torch.no_grad():
        torch.testing.assert_close(got, hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)


LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def test_rope_freqs_table_applies_llama3_scaling(tmp_path: Path) -> None:
    """llama.cpp stores llama3 rope scaling only as a `rope_freqs` tensor; the model must then equal
    HF's llama3-scaled model on the same weights (and differ from the unscaled one)."""
    freqs = llama_cpp_rope_freqs(64, 10000.0, LLAMA3_ROPE)
    assert (freqs != 1.0).any()
    path = write_llama_gguf(tmp_path / "llama3.gguf", {}, rope_freqs=freqs)
    config, reference = _transformers_tensors(path)
    ours = load_model(config, tmp_path, gguf_file=path.name)
    ids = torch.randint(0, config.vocab_size, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    (got,) = PagedBatch.for_model(ours).run(ours, [("r", ids)])

    def hf_logits(rope_parameters: dict) -> torch.Tensor:
        hf_config = copy.deepcopy(config)
        hf_config.rope_parameters = rope_parameters
        hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
        missing, unexpected = hf.load_state_dict(reference, strict=False)
        assert not unexpected and not missing
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]

    llama3 = hf_logits({"rope_type": "llama3", "rope_theta": 10000.0, **LLAMA3_ROPE})
    torch.testing.assert_close(got, llama3, atol=1e-4, rtol=0)
    unscaled = hf_logits({"rope_type": "default", "rope_theta": 10000.0})
    assert (unscaled - llama3).abs().max() > 1e-2


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
    # Not strict only because the tied LM head is absent from the file; nothing else may be.
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
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
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2' is not supported; supported: .*llama"):
        next(iterate_gguf(path))


def test_unsupported_tensor_type_is_a_clear_error(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "iq.gguf", {"ffn_up": Q.IQ4_NL})
    config = hf_config_from_gguf(read_gguf_header(path))
    with pytest.raises(ModelLoadError, match=r"ffn_up.weight' has type IQ4_NL, which is not supported"):
        load_model(config, tmp_path, gguf_file=path.name)


def test_missing_or_corrupt_gguf_is_a_clear_error(tmp_path: Path) -> None:
    config = hf_config_from_gguf(read_gguf_header(write_llama_gguf(tmp_path / "ok.gguf", {})))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(config, tmp_path, gguf_file="absent.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(config, tmp_path, gguf_file="bad.gguf")


def test_corrupt_counts_are_refused_at_once(tmp_path: Path) -> None:
    """Counts in a GGUF header bounded by the file's size: a huge tensor count was a bare OverflowError,
    and a huge count of small items a loop for ages."""
    path = write_llama_gguf(tmp_path / "ok.gguf", {})
    data = path.read_bytes()
    name = data.index(b"token_embd.weight")
    # (offset of the count, its struct format, what the error says)
    cases = [
        (8, "<Q", "tensors"),
        (16, "<Q", "metadata entries"),
        (24, "<Q", "bytes of a string"),  # the first key's length
        (name + len("token_embd.weight"), "<I", "dimensions of tensor 'token_embd.weight'"),
    ]
    for offset, fmt, what in cases:
        bad = tmp_path / f"bad-{offset}.gguf"
        huge = 2**32 - 1 if fmt == "<I" else 2**62
        bad.write_bytes(data[:offset] + struct.pack(fmt, huge) + data[offset + struct.calcsize(fmt) :])
        start = time.monotonic()
        with pytest.raises(
            ModelLoadError, match=rf"{bad}: truncated or corrupt GGUF header \(it claims {huge} {what}"
        ):
            read_gguf_header(bad)
        assert time.monotonic() - start < 5
