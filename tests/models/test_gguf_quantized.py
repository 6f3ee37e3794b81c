"""GGUF models run from their blocks (`quantization="gguf"`): for each block type, a tiny Llama written
as GGUF (quantized with gguf's own functions where it has them, else valid random blocks) generates 16
greedy tokens equal to HF transformers' on the dequantized weights, with bounded log-probabilities;
the weights stay as stored; bad files fail at load naming file, tensor and type."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention.paged_batch import PagedBatch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_llama_gguf
from perplexity import smollm2_perplexity
from test_gguf import _transformers_tensors
from transformers import AutoModelForCausalLM

from pagedllm.formats.gguf_metadata import hf_config_from_gguf, read_gguf_header
from pagedllm.layers.quant.gguf import GGUFLinearMethod, GGUFQuantizationConfig
from pagedllm.models import ModelLoadError, load_model

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
STEPS = 16
# Per-token log-probability difference allowed against HF on the same (dequantized) weights. The only
# difference is in the activations: the int8 kernel (every decode step here) quantizes each 32-element
# block of a linear layer's input to int8, as llama.cpp does, a rounding of at most 1/254 of the block's largest element, which moves each product by ~0.5% of its
# scale. Through the layers and the LM head of these models (logits of magnitude 2-5) that is up to
# 0.20 nats, measured over 10 seeds and every type; 0.3 bounds it, while a block read wrongly moves
# log-probabilities by whole nats. Float-typed weights are multiplied in float: only summation order.
LOGPROB_BOUND = 0.3
FLOAT_BOUND = 1e-4
# A seed whose greedy paths have no near-tie closer than the rounding above (about one seed in five
# has one somewhere in 13 types x 16 steps, where the int8 activations may pick the other token).
SEED = 8


def _greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """16 greedy tokens after `prompt` (prefilled in one step, then one-token decode steps) and the
    log-probabilities each step computed."""
    batch = PagedBatch.for_model(model, num_blocks=16)
    (logits,) = batch.run(model, [("r", prompt)])
    rows, tokens = [logits[-1]], []
    for _ in range(STEPS):
        tokens.append(int(rows[-1].argmax()))
        if len(tokens) == STEPS:
            break
        (logits,) = batch.run(model, [("r", [tokens[-1]])])
        rows.append(logits[-1])
    return tokens, torch.log_softmax(torch.stack(rows).float(), -1)


def assert_greedy_like_hf(
    model: torch.nn.Module, hf: torch.nn.Module, prompt: list[int], bound: float
) -> None:
    """`model`'s 16 greedy tokens after `prompt` equal HF's argmax on the same sequence, and each
    step's log-probabilities are within `bound` of HF's."""
    tokens, logprobs = _greedy(model, prompt)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    hf_logprobs = torch.log_softmax(hf_logits.float(), -1)
    assert tokens == hf_logprobs.argmax(-1).tolist()
    assert (logprobs - hf_logprobs).abs().max() < bound


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_model_matches_hf_on_dequantized_weights(tmp_path: Path, qtype: Q) -> None:
    types = dict.fromkeys((*LINEARS, "token_embd", "output"), qtype)
    path = write_llama_gguf(tmp_path / "tiny.gguf", types, seed=SEED)
    config, reference = _transformers_tensors(path)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.load_state_dict(reference)
    ours = load_model(config, tmp_path, gguf_file=path.name, quant_config=GGUFQuantizationConfig())
    assert isinstance(ours.model.layers[0].self_attn.qkv_proj.quant_method, GGUFLinearMethod)
    # 12 tokens: the prompt runs the dequantized-tile path, each decode step the int8 kernel.
    prompt = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_greedy_like_hf(ours, hf, prompt, FLOAT_BOUND if qtype in (Q.F16, Q.BF16, Q.F32) else LOGPROB_BOUND)


def test_weights_stay_as_stored(tmp_path: Path) -> None:
    """No float copy of a quantized weight: the layers hold the file's bytes (mapped, not copied,
    where no row permutation applies), no float weight parameter exists besides the norms, and after
    running, the modules hold no more than the quantized bytes (+10%)."""
    types = dict.fromkeys((*LINEARS, "token_embd", "output"), Q.Q4_K)
    path = write_llama_gguf(tmp_path / "tiny.gguf", types)
    config = hf_config_from_gguf(read_gguf_header(path))
    ours = load_model(config, tmp_path, gguf_file=path.name, quant_config=GGUFQuantizationConfig())
    float_params = [n for n, p in ours.named_parameters() if p.is_floating_point() and p.dim() > 1]
    assert float_params == []
    down = ours.model.layers[0].mlp.down_proj.qweight_0
    assert down.dtype == torch.uint8 and down.shape == (256, 512 // 256 * 144)
    assert not down.numpy().flags.owndata  # a view of the memory-mapped file
    quantized = sum(b.numel() for n, b in ours.named_buffers() if "qweight" in n)
    quantized += sum(p.numel() for n, p in ours.named_parameters() if p.dtype == torch.uint8)
    assert quantized >= 0.99 * path.stat().st_size - 16384  # the file is (nearly) all weight blocks
    weights = sum(p.nbytes for p in ours.parameters()) + sum(b.nbytes for b in ours.buffers() if b.dtype == torch.uint8)
    assert weights <= 1.1 * quantized  # the norms besides the blocks
    # A prompt (dequantized tiles) and decode steps (int8 kernel) leave no tensor behind on any module
    # (parameter, buffer or attribute a layer might cache), the KV cache the runner binds aside.
    before = _held_tensors(ours)
    prompt = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    _greedy(ours, prompt)
    assert _held_tensors(ours) == before


def _held_tensors(model: torch.nn.Module) -> dict[int, int]:
    """Bytes of each tensor the modules hold, by address (the runner's KV cache aside)."""
    return {
        t.data_ptr(): t.nbytes
        for m in model.modules()
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False), *vars(m).items()]
        if isinstance(t, torch.Tensor) and name != "kv_cache"
    }


def test_unsupported_type_is_refused_naming_tensor_and_type(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "iq.gguf", {"ffn_up": Q.IQ4_NL})
    config = hf_config_from_gguf(read_gguf_header(path))
    with pytest.raises(
        ModelLoadError, match=r"iq.gguf: tensor 'blk.0.ffn_up.weight' has type IQ4_NL, which is not supported"
    ):
        load_model(config, tmp_path, gguf_file=path.name, quant_config=GGUFQuantizationConfig())


def test_truncated_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "cut.gguf", dict.fromkeys(LINEARS, Q.Q4_0))
    config = hf_config_from_gguf(read_gguf_header(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelLoadError, match=r"cut.gguf.*(truncated|not a readable GGUF)"):
        load_model(config, tmp_path, gguf_file=path.name, quant_config=GGUFQuantizationConfig())


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 263 eight-token steps: ~10 min on the loaded 2-core VM, far less when quiet
def test_smollm2_perplexity_quantized_within_1_percent(smollm2_gguf: Path) -> None:
    """The embedded SmolLM2 Q4_1 model's perplexity run from its blocks, in 8-token steps so every
    product takes the int8 kernel, within 1% of the same file dequantized (the float path,
    whole-prompt steps)."""
    reference = smollm2_perplexity(smollm2_gguf, None, 1024)
    quantized = smollm2_perplexity(smollm2_gguf, GGUFQuantizationConfig(), 8)
    assert abs(quantized / reference - 1) < 0.01, (quantized, reference)


@pytest.mark.parametrize(("extra", "runs_blocks"), [({}, False), ({"gguf_dequantize": False}, True)])
def test_engine_dequantizes_gguf_unless_told_not_to(tmp_path: Path, extra: dict, runs_blocks: bool) -> None:
    """The engine fills quantization='gguf' for a GGUF file; its model runs from the blocks only with
    model_loader_extra_config gguf_dequantize=false (the float path is the default)."""
    from pagedllm.config import EngineConfig, LoadConfig, ModelConfig
    from pagedllm.models import get_model
    from pagedllm.models.loader import effective_quant_config, reload_weights
    from pagedllm.models.loader.quantization import resolve_quant_config

    path = write_llama_gguf(tmp_path / "tiny.gguf", dict.fromkeys(LINEARS, Q.Q4_0))
    engine_config = EngineConfig(
        model_config=ModelConfig(model=str(path), dtype="float32"),
        load_config=LoadConfig(model_loader_extra_config=extra),
    )
    quant = resolve_quant_config(engine_config.model_config)
    assert quant is not None and quant.name == "gguf"
    model = get_model(engine_config)
    method = model.model.layers[0].self_attn.qkv_proj.quant_method
    assert isinstance(method, GGUFLinearMethod) == runs_blocks
    assert (effective_quant_config(engine_config) is not None) == runs_blocks
    if not runs_blocks:
        # Dequantized weights can be read again (sleep mode level 2 wakes up this way).
        weight = model.model.layers[0].self_attn.qkv_proj.weight
        expected = weight.detach().clone()
        weight.data.zero_()
        reload_weights(model, engine_config)
        assert torch.equal(weight, expected)
