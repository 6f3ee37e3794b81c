"""Benchmark models that need no download.

    python3 scripts/make_bench_model.py OUT_DIR [--qwen3-moe]
        An HF directory shaped like SmolLM2-135M (random weights, a word-level tokenizer of the same
        vocabulary size) for machines where the embedded GGUF cannot travel (the GPU check); with
        `--qwen3-moe`, a mixture of experts shaped like Qwen3-30B-A3B scaled down to this CPU (its 128
        experts, 8 per token, normalized top-k weights; a quarter of its widths, 6 of its 48 layers).

    python3 scripts/make_bench_model.py --llama-1b DIR [--llama-python PY]
        The peer benchmark's 1B model (benchmarks/peers): a Llama of hidden 2048, 16 layers, 32 heads,
        8 KV heads, intermediate 8192 with SmolLM2's vocabulary, tokenizer and chat template (read from
        the embedded package), random weights, bf16 safetensors in DIR; and in DIR/gguf the same weights
        as a BF16 GGUF and llama.cpp's Q4_0, Q8_0 and Q4_K_M quantizations of it (`llama_model_quantize`,
        run by PY: a Python with llama-cpp-python, default $PAGEDLLM_PEERS/llama-venv/bin/python).

    python3 scripts/make_bench_model.py --smollm2 DIR
        The embedded SmolLM2-135M-Instruct as an HF bf16 directory (its Q4_1 GGUF dequantized, with its
        tokenizer and chat template), for engines that take HF directories only.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm import tqdm
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 49152
# llama.cpp's file types (enum llama_ftype) of the quantized files written beside the BF16 GGUF.
LLAMA_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}
INIT_STD = 0.02


def _smollm2_shaped() -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def _qwen3_moe() -> PreTrainedModel:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen3MoeForCausalLM(config)


def write_shaped(out: Path, moe: bool = False) -> None:
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    ).save_pretrained(out)
    torch.manual_seed(0)
    model = _qwen3_moe() if moe else _smollm2_shaped()
    model.to(torch.bfloat16).save_pretrained(out)


# --- the embedded SmolLM2 package: tokenizer and weights ------------------------------------------------


def embedded_gguf() -> Path:
    from pagedllm.formats.model_source import embedded_model_path

    return embedded_model_path()


def save_embedded_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer and chat template, converted from the embedded GGUF by transformers."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def write_smollm2(out: Path) -> None:
    """The embedded model dequantized to an HF bf16 directory."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf = embedded_gguf()
    steps = tqdm(total=2, desc="smollm2", unit="step")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    steps.update()
    # transformers will not save a model it loaded from GGUF: the dense weights and the config go by hand.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]  # engines pick their model class by it
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    weights = {name: t.contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_embedded_tokenizer(out)
    steps.update()
    steps.close()


# --- the 1B Llama -------------------------------------------------------------------------------------


def llama_1b_config(**overrides) -> LlamaConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # as Llama-3.2-1B and SmolLM2
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def random_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights drawn tensor by tensor: normal(0, 0.02), the projections that write into the
    residual stream (o_proj, down_proj) scaled by 1/sqrt(2 * layers) as GPT-2 does so the stream's
    scale stays put through the layers, norms at one. The logits come out spread (not one-hot, not
    flat): greedy decoding of the peers runs over varied tokens."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * config.num_hidden_layers)
    weights = {}
    for name, shape in tqdm(shapes.items(), desc="random weights", unit="tensor"):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
        weights[name] = torch.empty(shape).normal_(0.0, std, generator=gen).to(torch.bfloat16)
    return weights


def write_llama_hf(out: Path, config: LlamaConfig, seed: int = 0) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(random_state_dict(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})


def _gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of an HF Llama tensor (llama.cpp's naming)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")  # model.layers.N.<module>.<proj>.weight
    block, rest = parts[2], ".".join(parts[3:])
    names = {
        "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_proj.weight": "attn_q",
        "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v",
        "self_attn.o_proj.weight": "attn_output",
        "mlp.gate_proj.weight": "ffn_gate",
        "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down",
    }
    return f"blk.{block}.{names[rest]}.weight"


def _rope_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a q/k projection to GGUF's interleaved pairs (what llama.cpp's
    converter does: within each head, rows i and i + d/2 become neighbours)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(hf_dir: Path, out_file: Path) -> None:
    """The HF Llama of `hf_dir` (bf16 safetensors) as a BF16 GGUF with the embedded SmolLM2 file's
    tokenizer, streamed tensor by tensor."""
    import gguf
    from safetensors import safe_open

    config = LlamaConfig.from_pretrained(hf_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    source = gguf.GGUFReader(embedded_gguf())
    writer = gguf.GGUFWriter(out_file, "llama")
    writer.add_name("pagedllm-bench-llama-1b")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            shape = f.get_slice(name).get_shape()
            dtype = _stored_dtype(name)
            writer.add_tensor_info(
                _gguf_name(name), shape, dtype, math.prod(shape) * dtype.itemsize, raw_dtype=_weight_type(name)
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name in tqdm(names, desc=f"write {out_file.name}", unit="tensor"):
            tensor = f.get_tensor(name)
            if name.endswith("q_proj.weight"):
                tensor = _rope_interleaved(tensor, config.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                tensor = _rope_interleaved(tensor, config.num_key_value_heads)
            # bf16 has no numpy type: its bits go as uint16 (the GGUF type says what they are).
            bits = tensor.float().numpy() if _stored_dtype(name) == np.float32 else tensor.view(torch.int16).numpy()
            writer.write_tensor_data(np.ascontiguousarray(bits).view(_stored_dtype(name)))
    writer.close()


def _weight_type(name: str):
    import gguf

    # Norm vectors stay float32 as llama.cpp's converter keeps 1-D tensors.
    return gguf.GGMLQuantizationType.F32 if name.endswith("norm.weight") else gguf.GGMLQuantizationType.BF16


def _stored_dtype(name: str) -> np.dtype:
    return np.dtype(np.float32) if name.endswith("norm.weight") else np.dtype(np.uint16)


def default_llama_python() -> Path:
    return Path(os.environ.get("PAGEDLLM_PEERS", "/work/peers")) / "llama-venv" / "bin" / "python"


_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def quantize(python: Path, source: Path, out: Path, ftype: int) -> None:
    """llama.cpp's `llama_model_quantize` of `source` to `out` (llama-cpp-python's bindings, run by
    `python`, a venv that has them)."""
    threads = len(os.sched_getaffinity(0))
    result = subprocess.run(
        [str(python), "-c", _QUANTIZE, str(source), str(out), str(ftype), str(threads)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"llama_model_quantize {out.name} failed ({result.returncode}): {result.stderr[-2000:]}")


def write_llama_1b(out: Path, llama_python: Path | None, seed: int = 0) -> None:
    if llama_python is not None and not llama_python.exists():
        raise SystemExit(
            f"{llama_python} not found: install the peers first (benchmarks/peers/install.sh), pass "
            "--llama-python, or --no-quantize for the HF directory and BF16 GGUF only"
        )
    write_llama_hf(out, llama_1b_config(), seed)
    save_embedded_tokenizer(out)
    gguf_dir = out / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    bf16 = gguf_dir / "llama-1b-BF16.gguf"
    write_llama_gguf(out, bf16)
    if llama_python is None:
        return
    for name, ftype in tqdm(LLAMA_FTYPES.items(), desc="llama_model_quantize", unit="file"):
        quantize(llama_python, bf16, gguf_dir / f"llama-1b-{name}.gguf", ftype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, help="SmolLM2-shaped (or --qwen3-moe) random HF model")
    parser.add_argument("--qwen3-moe", action="store_true")
    parser.add_argument("--llama-1b", type=Path, metavar="DIR")
    parser.add_argument("--smollm2", type=Path, metavar="DIR")
    parser.add_argument("--llama-python", type=Path, default=None, help="default: " + str(default_llama_python()))
    parser.add_argument("--no-quantize", action="store_true", help="--llama-1b without the quantized GGUFs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.out or args.llama_1b or args.smollm2):
        parser.error("give OUT_DIR, --llama-1b DIR or --smollm2 DIR")
    if args.out:
        write_shaped(args.out, args.qwen3_moe)
    if args.smollm2:
        write_smollm2(args.smollm2)
    if args.llama_1b:
        python = None if args.no_quantize else (args.llama_python or default_llama_python())
        write_llama_1b(args.llama_1b, python, args.seed)


if __name__ == "__main__":
    sys.exit(main())
