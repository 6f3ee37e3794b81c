"""The model forward as each compilation mode runs it (optimization levels O1 and up).

* `NONE` (O0): the eager module.
* `STOCK_TORCH_COMPILE`: plain `torch.compile` of the whole forward; Dynamo guards and recompiles as
  usual.
* `DYNAMO_TRACE_ONCE` and `VLLM_COMPILE`: the model's repeated decoder block (the layers it declares
  with `decoder_layers()`) is traced once per *shape class* of the flattened batch, and that one graph runs
  every layer: the layers differ only in their weights, which the graph takes as inputs read from the
  layer it is called with. Dynamo guards are skipped (the class is chosen here, on the host, before the
  call), so a step never recompiles once its class was compiled. Tracing one block instead of the
  whole stack makes cold compiles and warm starts ~N-layers times cheaper. The embedding, final norm and
  LM head stay eager (one or two kernels each).

  The shape classes are the compile ranges of the configuration (`compile_ranges_endpoints`: token
  counts `(previous end, end]`, each compiled with a dynamic token dimension) and the static sizes
  (`compile_sizes`, plus 1: a single decode is the latency-critical shape, and Dynamo specializes size
  1 anyway). `VLLM_COMPILE` hands the graphs to Inductor with the configured options and an on-disk
  cache under a directory named by the configuration hash, so a second start skips code generation.

Attention is an opaque custom op (`pagedllm::unified_attention`), so a block is one graph.

Where the model declares a native path (`SupportsNativeDecode`, e.g.
`pagedllm.models.native.llama_decode`) and it accepts the loaded model, `native` holds it: a step of
a few decode tokens only (one sequence decoding, a few together, or one verifying its drafts: up to
its `max_rows`) can run the model body (embedding, decoder layers, final norm) in one native call.
The runner chooses per step (`pagedllm.worker.forward_paths`); the graphs of those sizes still serve
every other model and every step the path declines.

Once a (block, shape class) is compiled, later calls skip Dynamo's frame evaluation: the bytecode
Dynamo generated for that compile (which fetches the graph's inputs from the block and calls the
compiled graph) is captured with a bytecode hook and called as a plain function: `torch.compile`'s
wrapper costs several times its Python per call, a visible share of a many-layer single-sequence
decode step (benchmarks/RESULTS.md, "Figures behind code choices"). Guards are skipped either way, so
nothing that ran is lost; where the hook is missing or the capture is ambiguous the wrapper stays in
use.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import time
import types
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.config.compilation import CompilationMode
from pagedllm.config.utils import cache_root
from pagedllm.layers import bf16_gemm, skinny_gemm
from pagedllm.layers.graph_key import GraphKeyContributor, check_owned
from pagedllm.models.interfaces import HasDecoderLayers, NativeDecoder, SupportsNativeDecode

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.compile")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ShapeClass = tuple[str, int]


def compile_cache_dir(engine_config: EngineConfig) -> Path:
    """`<root>/<config hash>`: the root is `compilation_config.cache_dir`, else
    `torch_compile_cache` under pagedllm's cache root (`pagedllm.config.utils.cache_root`)."""
    root = engine_config.compilation_config.cache_dir
    base = Path(root) if root else cache_root() / "torch_compile_cache"
    return base / engine_config.compute_hash()


def _call_capturing_bytecode(
    compiled: Callable[..., Any], original: types.FunctionType, *args: Any
) -> tuple[Any, Callable[..., Any] | None]:
    """`compiled(*args)` for the first time (a `torch.compile` of `original` that compiles now), and
    `original` rebuilt around the bytecode Dynamo generated for that compile (None where it cannot
    be captured: no hook in this torch, or not exactly one compile of `original` in the call)."""
    hooks = getattr(getattr(torch._dynamo, "convert_frame", None), "register_bytecode_hook", None)
    if hooks is None:
        return compiled(*args), None
    captured: list[types.CodeType] = []

    def hook(old: types.CodeType, new: types.CodeType) -> None:
        if old is original.__code__:
            captured.append(new)

    handle = hooks(hook)
    try:
        out = compiled(*args)
    finally:
        handle.remove()
    if len(captured) != 1 or captured[0].co_freevars != original.__code__.co_freevars:
        logger.debug(
            "%s: %d bytecode captures; its compiled wrapper stays", original.__qualname__, len(captured)
        )
        return out, None
    code = captured[0]
    return out, types.FunctionType(
        code, original.__globals__, original.__name__, original.__defaults__, original.__closure__
    )


class CompiledForward:
    """`(input_ids, positions) -> hidden_states` with the decoder blocks compiled per shape class (see
    the module doc). Replaces each block's `forward` (and the model's `compute_logits`) with a
    dispatcher."""

    def __init__(
        self, model: nn.Module, engine_config: EngineConfig, contributors: Sequence[GraphKeyContributor]
    ) -> None:
        cc = engine_config.compilation_config
        self.model = model
        self.mode: CompilationMode = cc.mode
        self.backend: str = cc.backend or "inductor"
        self.inductor_options: dict[str, Any] = dict(cc.inductor_compile_config)
        max_tokens = engine_config.scheduler_config.max_num_batched_tokens
        self.range_ends: list[int] = sorted(set(cc.compile_ranges_endpoints or [max_tokens]))
        self.static_sizes: frozenset[int] = frozenset({1, *(cc.compile_sizes or [])})
        few = skinny_gemm.MAX_ROWS
        if few < max(self.range_ends) and next(model.parameters()).device.type == "cpu" and skinny_gemm.available():
            # Steps of 2..few tokens (a few decodes, or one request verifying its drafts) get their own
            # graphs: the projections run the few-row kernel there, which `linear` only picks where the
            # traced range proves the row count in bounds.
            self.range_ends = sorted({*self.range_ends, few})
        self.cache_dir: Path | None = None
        if self.mode == CompilationMode.VLLM_COMPILE and self.backend == "inductor":
            self.cache_dir = compile_cache_dir(engine_config)
            # Read by Inductor's FX-graph and AOT caches whenever they look up an entry. Inductor has no
            # config setting for it: its `cache_dir()` reads (and itself writes) this variable.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir / "inductor")
        # Graphs Dynamo handed to the backend in this process, and how many of those Inductor loaded
        # from its on-disk cache instead of generating code.
        self.num_graphs = 0
        self.num_cache_hits = 0
        self._key: ShapeClass | None = None
        # One compiled function per (block class, every contributor's block key, shape class, step
        # keys, which arguments are None): Dynamo's guards, which would tell a `residual=None` first
        # layer, a sliding-window layer or a step with LoRA adapters from the others, are skipped, so
        # the key must (`pagedllm.layers.graph_key`).
        self._fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._blocks: list[nn.Module] = []
        self._contributors = tuple(contributors)
        # The step keys of the call in progress (asked once per step, not per block).
        self._step_key: tuple[Hashable, ...] = ()
        # Steps of a few decode tokens only, in one native call where the model allows it.
        self.native: NativeDecoder | None = None
        if self.mode == CompilationMode.STOCK_TORCH_COMPILE:
            self._stock: Forward = torch.compile(model, backend=self.backend)  # type: ignore[assignment]
            return
        if not isinstance(model, HasDecoderLayers) or not model.decoder_layers():
            raise ValueError(
                f"{type(model).__name__} declares no decoder layers to compile (decoder_layers())"
            )
        self._blocks = list(model.decoder_layers())
        check_owned(self._blocks, self._contributors)
        # The LM head of a single row (one sequence decoding) is a matrix-vector product over the
        # whole vocabulary: compiled, it streams the weight (see `pagedllm.layers.linear.linear`). A
        # bfloat16 head the batch-invariant kernel serves streams it already (and must: its rows are
        # computed the same way at every row count), so it is not compiled.
        self._logits_fn: types.FunctionType = type(model).compute_logits
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        self._compile_head = not (isinstance(head, torch.Tensor) and bf16_gemm.serves(head[:1], head))
        self._single_row_logits = self._compile(self._logits_fn)
        # `(model, hidden) -> logits` once compiled: the captured bytecode, else the compiled wrapper.
        self._single_row_call: Callable[..., torch.Tensor] | None = None
        model.compute_logits = self._compute_logits  # type: ignore[method-assign]
        for block in self._blocks:
            signature = (type(block), *(c.graph_key(block) for c in self._contributors))
            block.forward = functools.partial(self._run_block, block, signature)  # type: ignore[method-assign]
        self.native = model.native_decoder() if isinstance(model, SupportsNativeDecode) else None

    def _compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] != 1 or not self._compile_head:
            return self._logits_fn(self.model, hidden_states)
        if self._single_row_call is not None:
            return self._single_row_call(self.model, hidden_states)
        out, direct = _call_capturing_bytecode(
            self._single_row_logits, self._logits_fn, self.model, hidden_states
        )
        self._single_row_call = direct or self._single_row_logits
        return out

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(
            fn,
            backend=self._backend,
            fullgraph=True,
            dynamic=False,
            isolate_recompiles=True,
            options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
        )

    def shape_class(self, num_tokens: int) -> ShapeClass:
        """("size", n) for a static size, else ("range", i) for the i-th compile range."""
        if num_tokens in self.static_sizes:
            return ("size", num_tokens)
        i = bisect.bisect_left(self.range_ends, num_tokens)
        if i == len(self.range_ends):
            raise ValueError(f"{num_tokens} tokens exceed the last compile range end {self.range_ends[-1]}")
        return ("range", i)

    def warm_up_sizes(self) -> list[int]:
        """One token count per shape class (static sizes first), for compiling ahead of requests."""
        return sorted(self.static_sizes) + [self._range_bounds(i)[0] for i in range(len(self.range_ends))]

    def _range_bounds(self, i: int) -> tuple[int, int]:
        lo = self.range_ends[i - 1] + 1 if i else 1
        # Size 1 is always a static class, so no range needs it (Dynamo cannot make 1 dynamic).
        return max(lo, 2), self.range_ends[i]

    def _describe(self, key: ShapeClass) -> str:
        return f"{key[1]} tokens" if key[0] == "size" else "{}..{} tokens".format(*self._range_bounds(key[1]))

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.num_graphs += 1
        if self.mode == CompilationMode.VLLM_COMPILE and self.backend == "inductor":
            from torch._dynamo.utils import counters
            from torch._inductor.compile_fx import compile_fx

            hits = counters["inductor"]["fxgraph_cache_hit"]
            compiled = compile_fx(gm, list(example_inputs), config_patches=self.inductor_options)
            self.num_cache_hits += counters["inductor"]["fxgraph_cache_hit"] - hits
        else:
            compiled = torch._dynamo.lookup_backend(self.backend)(gm, list(example_inputs))
        return compiled

    def _run_block(self, block: nn.Module, signature: tuple[Any, ...], *args: Any) -> Any:
        key = self._key
        if key is None:  # called outside __call__ (a profiling run, a test driving the model)
            return type(block).forward(block, *args)
        full_key = (*signature, key, self._step_key, tuple(a is None for a in args))
        fn = self._fns.get(full_key)
        if fn is not None:
            return fn(block, *args)
        forward = signature[0].forward
        fn = self._compile(forward)
        if key[0] == "range":
            lo, hi = self._range_bounds(key[1])
            for t in args:
                if isinstance(t, torch.Tensor):
                    torch._dynamo.mark_dynamic(t, 0, min=lo, max=hi)
        graphs, start = self.num_graphs, time.perf_counter()
        out, direct = _call_capturing_bytecode(fn, forward, block, *args)
        self._fns[full_key] = direct or fn
        logger.info(
            "compiled %s for %s in %.1f s (%d graphs in this process, %d from the compile cache)",
            type(block).__name__,
            self._describe(key),
            time.perf_counter() - start,
            self.num_graphs,
            self.num_cache_hits,
        )
        if self.num_graphs == graphs:
            logger.debug("shape class %s reused an existing graph", key)
        return out

    def describe_step(self, num_tokens: int) -> str:
        """The shape class a step of `num_tokens` runs in, in words (for the decode-path log)."""
        if self.mode == CompilationMode.STOCK_TORCH_COMPILE:
            return "any size (torch.compile)"
        return self._describe(self.shape_class(num_tokens))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The graphs' forward of the step (the native path is the runner's to try first)."""
        if self.mode == CompilationMode.STOCK_TORCH_COMPILE:
            return self._stock(input_ids, positions)
        self._key = self.shape_class(input_ids.shape[0])
        self._step_key = tuple(c.step_graph_key() for c in self._contributors)
        try:
            return self.model(input_ids, positions)
        finally:
            self._key = None
