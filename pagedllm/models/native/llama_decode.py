"""Steps of Llama-family models in one native call (kernels/cpu/llama_decode.c, in the dense kernel
library), the C mirror of `pagedllm.models.llama`.

A step of a few decode tokens (one sequence decoding, a few decoding together, or one request
verifying its drafted tokens) is bound by reading every weight once. Through the compiled
decoder-block graphs it also pays per layer the Python of a graph call, its buffer allocations and the
attention op's dispatch; `LlamaNativeDecoder` instead runs the whole model body in one C call, from the
tokens' embedding rows through every decoder layer (matrix-vector products for one float32 token, the
few-row products of `pagedllm.layers.skinny_gemm` for several, the paged attention kernel) to the final
norm. `LlamaForCausalLM` (and the architectures built on it) declares this path (`native_decoder()`),
and `CompiledForward` uses it for steps of decode rows only (at most `max_rows` tokens, each request's
at most `MAX_DECODE_QUERY_LEN`) where `for_model` accepts the loaded model; every other step runs the
graphs.

A bfloat16 model with dense weights on an AVX512-BF16 CPU, whose attention layout the prompt kernel
serves, runs every step here instead (`every_step`: prompts, chunks, decode and verification rows
alike, each request a segment of the prompt-attention kernel, every product `pagedllm.layers.bf16_gemm`'s):
each token is computed the same way whatever else its step holds, so a request's tokens and logprobs
do not depend on its batch, its prompt's chunking or prefix-cache hits, or speculation (README:
Reproducibility). No graph is compiled for such a model unless a step declines this path (LoRA).

Accepted: the Llama model's layers (Llama, SmolLM2, Mistral with or without a sliding window, Qwen2
with its q/k/v biases, Qwen3 with its per-head q/k norms) on one tensor-parallel rank, whose
projections are each either
- a plain dense product (the linear method exposes a `dense_weight`): float32 weights on a CPU with
  AVX-512 or AVX2 + FMA, bfloat16 ones on a CPU with AVX512-BF16 (an AVX2-only CPU has no bfloat16
  dense path here); or
- a product the linear method runs natively itself (`native_matvec`: GGUF blocks, AWQ/GPTQ int4, fp8
  weights), called from the C loop on the input widened to float, in float32 or bfloat16 models;
LoRA-wrapped projections expose their base product, and a step where any token runs an adapter goes
to the graphs. Quantized products are matrix-vector entries, called once per token: a model with any
runs its one-token steps here and its steps of several tokens in the graphs (whose kernels read the
weights once for every row). Also: norms and biases of the activations' dtype, a KV cache of that dtype (an fp8
cache's per-layer scales are not in the C layer table), and an attention shape the decode-attention
kernel serves. An embedding kept quantized (GGUF) gathers its row through its own module before the
call; the LM head (tied or quantized) is never part of the call: the logits come from the model's
own head after it. Anything else keeps the compiled graphs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.torch_paged import TorchPagedAttentionImpl, native_decode_step
from pagedllm.forward_context import get_forward_context
from pagedllm.kernels import build
from pagedllm.kernels.abi import LlamaLayer, LlamaModel, SegmentArgs
from pagedllm.layers import bf16_gemm, skinny_gemm
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quant.base import NativeMatvec
from pagedllm.layers.rotary import RotaryEmbedding

logger = logging.getLogger("pagedllm.compile")

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_STEP_ARGTYPES = (
    [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build.cdll(build.DENSE)
    if lib is None:
        return None
    for fn in (*(getattr(lib, f"decode_step_{suffix}") for suffix in _DTYPES.values()), lib.model_step_bf16):
        fn.argtypes = _STEP_ARGTYPES
        fn.restype = ctypes.c_int
    return lib


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether the native library built here has the dense products of weights of `dtype` (float32
    needs AVX-512 or AVX2 + FMA, bfloat16 AVX512-BF16)."""
    lib = _library()
    return lib is not None and dtype in _DTYPES and bool(lib.native_decode_supported(dtype == torch.bfloat16))


def _projections(layer: nn.Module) -> tuple[LinearBase, LinearBase, LinearBase, LinearBase]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _unsupported(model: nn.Module) -> str | None:
    """Why the native decode path cannot run `model` (a `LlamaForCausalLM`) as loaded, or None."""
    body = model.model
    if not (body.is_first_stage and body.is_last_stage):  # type: ignore[union-attr]
        return "the model is split into pipeline stages (the native call runs every layer, embedding to final norm)"
    if body.aux_hidden_state_layers:  # type: ignore[union-attr]
        return "an EAGLE-3 head reads its intermediate hidden states, which the native call does not return"
    layers = body.layers  # type: ignore[union-attr]
    # Quantized projections hold integer (or no) parameters; every float one must be of one dtype.
    dtypes = {p.dtype for p in layers.parameters() if p.is_floating_point()}
    if (
        any(p.device.type != "cpu" for p in layers.parameters())
        or len(dtypes) != 1
        or not dtypes <= set(_DTYPES)
    ):
        return "its decoder weights are not all float32 or all bfloat16 on the CPU"
    (dtype,) = dtypes
    for layer in layers:
        projections = _projections(layer)
        dense = [m.quant_method.dense_weight(m) is not None for m in projections]
        if any(not d and m.quant_method.native_matvec(m) is None for d, m in zip(dense, projections)):
            return "its projections are neither plain dense products nor declare a native product"
        if any(dense) and not supports_dtype(dtype):
            return (
                f"the native library has no dense {dtype} product here (no C compiler, or no AVX-512 / "
                "AVX2 + FMA for float32, no AVX512-BF16 for bfloat16)"
            )
        if any(m.tp_size != 1 for m in projections):
            return "its layers are sharded across tensor-parallel ranks"
        if not isinstance(layer.self_attn.attn.impl, TorchPagedAttentionImpl):
            return "its attention backend is not the CPU paged backend"
    if len({layer.self_attn.attn.impl.sliding_window for layer in layers}) > 1:
        return "its layers have different sliding windows"
    # The C code takes one epsilon for every norm.
    if len({m.variance_epsilon for m in model.modules() if isinstance(m, RMSNorm)}) > 1:
        return "its norms have different epsilons"
    return None


class LlamaNativeDecoder:
    """`(input_ids, positions) -> hidden_states` for a step of at most `max_rows` decode tokens, or of
    any tokens at all (`every_step`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model.model  # type: ignore[union-attr]
        self.dtype = dtype
        lib = _library()
        self.fn = getattr(lib, f"decode_step_{_DTYPES[dtype]}")
        self.step_fn = lib.model_step_bf16  # type: ignore[union-attr]
        layers = self.model.layers
        first = layers[0].self_attn
        config = model.config  # type: ignore[union-attr]
        self.rotary: RotaryEmbedding = first.rotary_emb
        self.head_size = first.head_dim
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.window = first.attn.impl.sliding_window
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.intermediate_size = config.intermediate_size
        q_size, qkv_size = first.q_size, first.q_size + 2 * first.kv_size
        # The residual stream, then a quantized projection's float input and output.
        self._fixed_floats = max(self.hidden_size, q_size, self.intermediate_size) + max(
            self.hidden_size, qkv_size, 2 * self.intermediate_size
        )
        self._row_scratch = 2 * self.hidden_size + qkv_size + q_size + 3 * self.intermediate_size
        # Quantized products read their weights once per token: several tokens' steps go to the graphs.
        dense = all(
            m.quant_method.dense_weight(m) is not None for layer in layers for m in _projections(layer)
        )
        self.decode_rows = skinny_gemm.MAX_ROWS if dense else 1
        # A bfloat16 model with dense weights runs every step here (`model_step_bf16`), each token the
        # same way whatever the step holds (batch invariance), where its attention layout lets the
        # prompt kernel serve every request (the cache's block size and dtype checked when bound).
        self.every_step = (
            dense
            and dtype == torch.bfloat16
            and bf16_gemm.available()
            and cpu_decode.prompt_kernel_serves(self.head_size, self.num_heads // self.num_kv_heads)
        )
        self.max_rows = sys.maxsize if self.every_step else self.decode_rows
        self.floats = torch.empty(0, dtype=torch.float32)
        self.scratch = torch.empty(0, dtype=dtype)
        self._reserve(self.decode_rows)
        # Built at the first step (the KV caches are bound after the model is loaded).
        self._cache: torch.Tensor | None = None
        self._tensors: list[object] = []
        self._layers: ctypes.Array[LlamaLayer] | None = None
        self._model: LlamaModel | None = None
        self._layout: cpu_decode.DecodeLayout | None = None
        # This path computes the base model only, so it steps aside whenever a projection's method adds
        # to it (a token of the step runs a LoRA adapter: every layer's adapters share one step state).
        self.projection_methods = [m.quant_method for m in _projections(layers[0])]

    @classmethod
    def for_model(cls, model: nn.Module) -> LlamaNativeDecoder | None:
        """The decoder for `model`, or None (logged) where the native path cannot run it."""
        reason = _unsupported(model)
        if reason is None and _library() is None:
            reason = "the native library could not be built (no C compiler, or the kernel cache: see the warning)"
        if reason is not None:
            logger.info("single-sequence decode steps run the compiled graphs (the plain layers at -O0): %s", reason)
            return None
        dtype = model.model.layers[0].input_layernorm.weight.dtype  # type: ignore[union-attr]
        logger.info(
            "single-sequence decode steps run natively (one call from the embedding to the final norm)"
        )
        return cls(model, dtype)

    def runs_every_step(self, bound: bool) -> bool:
        return (
            self.every_step
            and not any(m.may_add_to_base() for m in self.projection_methods)
            and (not bound or self._bind())
        )

    def reserve(self, num_tokens: int) -> None:
        self._reserve(min(num_tokens, self.max_rows))

    def _reserve(self, rows: int) -> None:
        """Scratch for steps of up to `rows` tokens (kept for later steps: grown, never shrunk)."""
        floats = rows * self.hidden_size + self._fixed_floats
        if self.floats.numel() < floats:
            self.floats = torch.empty(floats, dtype=torch.float32)
        if self.scratch.numel() < rows * self._row_scratch:
            self.scratch = torch.empty(rows * self._row_scratch, dtype=self.dtype)

    def release(self) -> None:
        self._cache, self._layout, self._layers, self._model = None, None, None, None
        self._tensors = []

    def _layer_tensors(self) -> tuple[list[tuple[torch.Tensor | None, ...]], list[list[NativeMatvec | None]]]:
        """Each layer's tensors in `LlamaLayer`'s order (None: a bias or norm the model lacks, or the
        weight of a quantized projection) and its projections' native products (None: dense)."""
        rows, products = [], []
        for layer in self.model.layers:
            attn = layer.self_attn
            projections = _projections(layer)
            qkv, o, gate_up, down = (m.quant_method.dense_weight(m) for m in projections)
            products.append(
                [
                    m.quant_method.native_matvec(m) if w is None else None
                    for w, m in zip((qkv, o, gate_up, down), projections)
                ]
            )
            rows.append(
                (
                    layer.input_layernorm.weight,
                    qkv,
                    o,
                    layer.post_attention_layernorm.weight,
                    gate_up,
                    down,
                    attn.attn.kv_cache,
                    *(m.bias for m in projections),
                    *(norm.weight if norm is not None else None for norm in (attn.q_norm, attn.k_norm)),
                )
            )
        return rows, products

    def _dense_embedding(self) -> torch.Tensor | None:
        """The embedding table the C code reads rows of, or None where the embedding is kept quantized
        (then its module gathers the step's row before the call)."""
        embed = self.model.embed_tokens
        return embed.weight if getattr(embed, "quant_method", None) is None else None

    def _bind(self) -> bool:
        """Point the C layer table at the weights and the KV caches, once they are bound and again
        whenever they are bound anew (`bind_kv_cache` binds every layer's cache at once; weights are
        loaded before this object exists); False where the attention kernel cannot serve the caches
        (then steps run the graphs)."""
        cache = self.model.layers[0].self_attn.attn.kv_cache
        if cache is self._cache:
            return self._layout is not None
        self._cache, self._layout = cache, None
        rows, products = self._layer_tensors()
        if cache.dim() != 5 or any(row[6].shape != cache.shape for row in rows):  # type: ignore[union-attr]
            return False
        embedding = self._dense_embedding()
        ends = [t for t in (embedding, self.model.norm.weight) if t is not None]
        present = [*ends, *(t for row in rows for t in row if t is not None)]
        if not all(t.is_contiguous() and t.dtype == self.dtype for t in present):
            return False
        if embedding is not None and embedding.shape != (self.vocab_size, self.hidden_size):  # sharded
            return False
        if (
            not self.rotary.cos_sin_cache.is_contiguous()
            or self.rotary.cos_sin_cache.shape[1] != self.head_size
        ):
            return False
        # The attention layers' own test and layout, on tensors shaped as this path passes them.
        probe = torch.empty(1, self.num_heads, self.head_size, dtype=self.dtype)
        kv_probe = probe[:, : self.num_kv_heads]
        layout = self.model.layers[0].self_attn.attn.impl.native_layout(probe, kv_probe, kv_probe, cache)
        if not isinstance(layout, cpu_decode.DecodeLayout):
            return False
        if self.every_step and layout.prefill_fn is None:
            logger.info(
                "steps with prompts run the compiled graphs (the plain layers at -O0): the prompt kernel does not serve this layout"
            )
            self.every_step, self.max_rows = False, self.decode_rows
        # Kept alive with the table of their addresses.
        self._tensors = [*present, *(p for ps in products for p in ps if p is not None)]
        self._layers = (LlamaLayer * len(rows))(
            *(
                LlamaLayer(
                    *(t.data_ptr() if t is not None else None for t in row),
                    (ctypes.c_void_p * 4)(*(p.fn if p is not None else None for p in ps)),
                    (ctypes.c_void_p * 4)(*(p.desc if p is not None else None for p in ps)),
                )
                for row, ps in zip(rows, products)
            )
        )
        self._model = LlamaModel(
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            len(rows),
            self.vocab_size,
            self.model.norm.variance_epsilon,
            embedding.data_ptr() if embedding is not None else None,
            self.model.norm.weight.data_ptr(),
            ctypes.addressof(self._layers),
        )
        self._layout = layout
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states of the step's tokens, or None where it runs the graphs: a step with a
        prompt (unless `every_step`), without attention metadata (a warm-up or profiling run), with
        caches the attention kernel cannot serve, or when a token of the step runs a LoRA adapter."""
        rows = input_ids.shape[0]
        md = get_forward_context().attn_metadata
        if (
            rows > self.max_rows
            or md is None
            or any(m.adds_to_base() for m in self.projection_methods)
            or not self._bind()
            or rows > self.max_rows  # (binding may have found the prompt kernel unfit)
        ):
            return None
        assert self._cache is not None and self._layout is not None
        fn, step = self.fn, native_decode_step(md, self._cache.shape[3], self.window)
        if self.every_step:
            fn, step = self.step_fn, _Segments(md, rows)
            self._reserve(rows)
        elif step is None:  # a prompt longer than a decode row's few tokens
            return None
        if input_ids.dtype != torch.int64 or positions.dtype != torch.int64:
            raise TypeError(
                f"token ids and positions must be int64, not {input_ids.dtype} and {positions.dtype}"
            )
        table = self.rotary.cos_sin_cache
        assert self._model is not None
        if self._model.embedding is None:  # the C code starts from the rows written into `hidden`
            hidden = (
                self.model.embed_tokens(input_ids).to(self.dtype).reshape(rows, self.hidden_size).contiguous()
            )
        else:
            hidden = torch.empty(rows, self.hidden_size, dtype=self.dtype)
        status = fn(
            ctypes.byref(self._model),
            input_ids.data_ptr(),
            positions.data_ptr(),
            rows,
            table.data_ptr(),
            table.shape[0],
            hidden.data_ptr(),
            self.floats.data_ptr(),
            self.scratch.data_ptr(),
            step.pointer,
            self._layout.pointer,
        )
        if status == -4:
            bad = input_ids[(input_ids < 0) | (input_ids >= self.vocab_size)]
            raise IndexError(f"token id {int(bad[0])} is outside the vocabulary ({self.vocab_size} ids)")
        if status == -5:
            bad = positions[(positions < 0) | (positions >= table.shape[0])]
            raise IndexError(f"position {int(bad[0])} is outside the rotary table ({table.shape[0]} rows)")
        if status == -6:
            raise RuntimeError("a quantized projection's native product failed (status -6)")
        if status != 0:
            raise RuntimeError(f"native decode rejected the model's shapes (status {status})")
        return hidden


class _Segments:
    """A step's requests as segments of the prompt-attention kernel (`SegmentArgs`), with the tensors
    its addresses point into."""

    def __init__(self, md: AttentionMetadata, rows: int) -> None:
        n = md.num_reqs
        qsl = np.asarray(_host(md.query_start_loc_cpu, md.query_start_loc), dtype=np.int64)[: n + 1]
        seq = np.asarray(_host(md.seq_lens_cpu, md.seq_lens), dtype=np.int64)[:n]
        q_lens = np.diff(qsl)
        # Per request: first row, rows, tokens cached before them, block-table row.
        self.segs = torch.from_numpy(np.stack([qsl[:-1], q_lens, seq - q_lens, np.arange(n)], axis=1))
        self.tables = md.block_tables
        self.slots = md.slot_mapping[:rows].contiguous()
        if self.tables.dtype != torch.int32 or self.tables.stride(1) != 1 or self.slots.dtype != torch.int64:
            raise ValueError("block tables must be int32 with contiguous rows, slots int64")
        self.args = SegmentArgs(
            self.tables.data_ptr(),
            self.tables.stride(0),
            self.segs.data_ptr(),
            n,
            self.slots.data_ptr(),
            rows,
        )
        self.pointer = ctypes.pointer(self.args)


def _host(values: list[int] | None, tensor: torch.Tensor) -> list[int]:
    return values if values is not None else tensor.tolist()
