"""The model runner's start-up: sizing the KV cache (its spec, the memory budget, a profiling forward),
allocating and binding it, and compiling or warming up the forward before the first request.

Composed into `ModelRunner` (pagedllm/worker/model_runner.py) once its model is loaded; it owns the KV
cache tensors, the attention metadata builder and the KV connector's worker side it creates with them.
Kept apart because it runs once per start or wake-up, never per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention import AttentionMetadataBuilder, attention_layers, bind_kv_cache, get_attn_backend
from pagedllm.attention.encoder import EncoderOnlyMetadataBuilder
from pagedllm.distributed.kv_transfer import KVConnectorBase, KVConnectorRole, create_connector
from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.forward_context import set_forward_context
from pagedllm.kv_cache_interface import KVCacheSpec, allocate_zeroed
from pagedllm.lora.manager import LoRAManager
from pagedllm.models.interfaces import NativeDecoder
from pagedllm.spec_decode.runner import SpecDecodeRunner
from pagedllm.worker.compiled_forward import CompiledForward
from pagedllm.worker.kv_cache import (
    cpu_kv_cache_budget,
    profile_cuda_kv_cache_budget,
)
from pagedllm.worker.limits import RunnerLimits
from pagedllm.worker.pooling import PoolingRunner

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.worker")

# The runner's forward: (input_ids, positions) -> (hidden states, the auxiliary ones an EAGLE-3 head
# reads).
RunForward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]


class RunnerStartup:
    """KV cache sizing and allocation, profiling and warm-up of the runner's loaded model."""

    def __init__(
        self,
        engine_config: EngineConfig,
        kv_cache_dtype: torch.dtype,
        model: nn.Module,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        run_forward: RunForward,
        native_body: Callable[[], NativeDecoder | None],
        pooling: PoolingRunner | None,
        spec: SpecDecodeRunner | None,
        lora: LoRAManager | None,
    ) -> None:
        """`forward`: what each step calls (the model, or its compiled forward); `run_forward`: the
        runner's call of it (profiling and warm-up run through it, as steps do); `native_body`: the
        model's native body the steps may run (`ModelRunner.native_body`)."""
        self.engine_config = engine_config
        self.cache_config = engine_config.cache_config
        self.model_config = engine_config.model_config
        self.device = torch.device(engine_config.device_config.device)
        self.dtype: torch.dtype = self.model_config.dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.limits = RunnerLimits.of(engine_config)
        self.model = model
        self._forward = forward
        self._run_forward = run_forward
        self.native_body = native_body
        self.pooling = pooling
        self.spec = spec
        self.lora = lora
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        # Built with the cache (`initialize_kv_cache`): each step's attention metadata.
        self.attn_metadata_builder: AttentionMetadataBuilder | None = None
        # The KV connector's worker side (see distributed/kv_transfer), created with the cache.
        self.kv_connector: KVConnectorBase | None = None

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def get_kv_cache_spec(self) -> KVCacheSpec:
        layers = attention_layers(self.model)
        if not layers and self.pooling is not None:
            # An encoder keeps no KV cache: blocks are the scheduler's bookkeeping only (0 bytes each).
            return KVCacheSpec(
                block_size=self.limits.block_size, num_kv_heads=[], head_size=[], dtype=self.kv_cache_dtype
            )
        if not layers:
            raise RuntimeError(f"{type(self.model).__name__} has no attention layers to give a KV cache")
        return KVCacheSpec(
            block_size=self.limits.block_size,
            num_kv_heads=[layer.num_kv_heads for layer in layers.values()],
            head_size=[layer.head_size for layer in layers.values()],
            dtype=self.kv_cache_dtype,
        )

    def determine_available_kv_cache_bytes(self) -> int:
        """Bytes the KV cache may take: `kv_cache_memory_bytes` when set; else on CPU a share of the
        available RAM, on CUDA `gpu_memory_utilization * total` minus what a profiling forward at
        `max_num_batched_tokens` used."""
        spec = self.get_kv_cache_spec()
        if self.cache_config.kv_cache_memory_bytes is not None:
            budget = int(self.cache_config.kv_cache_memory_bytes)
        elif self.device.type == "cpu":
            max_useful_blocks = self.limits.max_num_reqs * self.limits.max_num_blocks_per_req
            pc = self.engine_config.parallel_config
            cores = 1 if pc.data_parallel_external_lb else pc.data_parallel_size
            budget = cpu_kv_cache_budget(self.weights_bytes(), max_useful_blocks * spec.bytes_per_block, cores)
        else:
            budget = profile_cuda_kv_cache_budget(
                self.device, self.cache_config.gpu_memory_utilization, self.profile_run
            )
        # A draft model's cache takes its share of the budget (as many blocks as the target's).
        share = 1.0 if self.spec is None else self.spec.kv_cache_share(spec.bytes_per_block, self.kv_cache_dtype)
        return int(budget * share)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward at the largest step size (attention without the cache) plus the largest logits
        and sampling batch, to measure peak activation memory."""
        model = self.model
        n = self.limits.max_num_tokens
        native = self.native_body()
        if native is not None and native.runs_every_step(bound=False):
            # The native body will run every step: its buffers are the activations (no graph compiled).
            native.reserve(n)
            hidden = torch.zeros(n, self.model_config.get_hidden_size(), dtype=self.dtype, device=self.device)
        else:
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            positions = torch.arange(n, dtype=torch.int64, device=self.device) % self.limits.max_model_len
            with set_forward_context(None):
                hidden, _ = self._run_forward(ids, positions)
        if self.pooling is not None or not get_pp_group().is_last_rank:
            return
        rows = min(self.limits.max_num_reqs, n)
        logits = model.compute_logits(hidden[-rows:])
        logits.argmax(dim=-1)
        del hidden, logits

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one tensor per attention layer (shape from the backend's `get_kv_cache_shape`)
        and bind it. Zero-filled: masked cache slots must never hold NaN/inf (0 * NaN = NaN in
        the attention's value product)."""
        model = self.model
        spec = self.get_kv_cache_spec()
        backend = get_attn_backend()
        self.kv_caches = [
            allocate_zeroed(
                backend.get_kv_cache_shape(num_blocks, self.limits.block_size, kv_heads, head_size),
                self.kv_cache_dtype,
                self.device,
            )
            for kv_heads, head_size in zip(spec.num_kv_heads, spec.head_size)
        ]
        bind_kv_cache(model, self.kv_caches)
        if self.spec is not None:
            self.spec.initialize_kv_cache(num_blocks, self.kv_cache_dtype)
        compiled = isinstance(self._forward, CompiledForward)
        layers = attention_layers(model)
        builder_cls = backend.get_builder_cls() if layers else EncoderOnlyMetadataBuilder
        self.attn_metadata_builder = builder_cls(
            layers.values(), self.dtype, self.device, compiled
        )
        self.num_blocks = num_blocks
        if self.kv_connector is None:  # (a wake-up re-allocates the cache, not the connector)
            self.kv_connector = create_connector(self.engine_config, KVConnectorRole.WORKER, spec)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)

    @torch.inference_mode()
    def compile_or_warm_up_model(self) -> None:
        """Build the attention backend's kernels and, at O1 and up, compile (or load from the compile
        cache) the forward of every shape class and the single-row LM head now, so that no request
        waits for a compiler. Attention runs without the cache here, as in `profile_run`: the graphs
        do not depend on the metadata."""
        if not self.engine_config.kernel_config.enable_jit_warmup:
            # Without the warm-up each kernel and shape class compiles when a step first needs it.
            return
        get_attn_backend().warm_up(self.device)
        forward = self._forward
        if not isinstance(forward, CompiledForward):
            return
        model = self.model
        start, graphs = time.perf_counter(), forward.num_graphs
        # Where the native body runs every step the graphs serve none: they compile only if a step
        # ever needs them.
        every_step = forward.native is not None and forward.native.runs_every_step(bound=True)
        hidden = torch.zeros(1, self.model_config.get_hidden_size(), dtype=self.dtype, device=self.device)
        for n in [] if every_step else forward.warm_up_sizes():
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            positions = torch.arange(n, dtype=torch.int64, device=self.device)
            # With LoRA, the graphs of steps with and without adapters.
            for _ in self.lora.warm_up_variants() if self.lora is not None else (None,):
                with set_forward_context(None):
                    hidden, _ = self._run_forward(ids, positions)
        model.compute_logits(hidden[-1:])
        logger.info(
            "compiled %d graphs in %.1f s (%d from the compile cache at %s)",
            forward.num_graphs - graphs,
            time.perf_counter() - start,
            forward.num_cache_hits,
            forward.cache_dir,
        )


    def metadata_builder(self) -> AttentionMetadataBuilder:
        """The builder of each step's attention metadata (made with the cache)."""
        if self.attn_metadata_builder is None:
            raise RuntimeError("ModelRunner.initialize_kv_cache() must be called first")
        return self.attn_metadata_builder

    def release_kv_cache(self) -> int:
        """Drop the KV cache (sleep mode; `initialize_kv_cache(num_blocks)` restores it): the layers keep
        empty tensors. Returns the bytes released."""
        released = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self.kv_caches = []
        bind_kv_cache(self.model, [torch.empty(0, device=self.device)] * len(attention_layers(self.model)))
        if self.spec is not None:  # a draft model's or EAGLE head's cache (re-allocated with the target's)
            released += self.spec.release_kv_cache()
        return released
