"""What the model-based drafters (draft model, EAGLE) share: a model of their own with a paged KV
cache addressed through the TARGET's block tables, and the batched forward over given positions.

The cache, as in vLLM: one tensor per drafter attention layer with as many blocks as the target's.
The scheduler allocates each request's blocks for both at once, with `num_lookahead_tokens` (= k)
slots past the scheduled tokens, where the drafter writes the KV of its own draft tokens before the
target has seen them; the target later overwrites its own cache at those positions, the drafter its.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.attention import CommonAttentionMetadata, attention_layers, bind_kv_cache, get_attn_backend
from pagedllm.config import EngineConfig
from pagedllm.forward_context import set_forward_context
from pagedllm.kv_cache_interface import KVCacheSpec, allocate_zeroed
from pagedllm.sample.ops import random_sample
from pagedllm.spec_decode.proposer import DraftBatch, DraftRequest, TargetStep


class ModelDrafter:
    """The `Proposer` parts of a drafter with a model and a KV cache of its own."""

    shadow_drafts = False

    def __init__(self, engine_config: EngineConfig) -> None:
        spec = engine_config.speculative_config
        if not spec.model:
            raise ValueError(f"speculative_config.method={spec.method!r} needs speculative_config.model")
        self.engine_config = engine_config
        self.device = torch.device(engine_config.device_config.device)
        self.dtype: torch.dtype = engine_config.model_config.dtype
        self.block_size: int = engine_config.cache_config.block_size
        self.greedy_drafts = spec.draft_sample_method == "greedy"
        # Drafts index the target's vocabulary.
        self.vocab_size: int = engine_config.model_config.get_vocab_size()
        self.model: nn.Module | None = None
        self.aux_hidden_layers: list[int] = []
        self.draft_probs: dict[str, torch.Tensor] = {}

    def require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.load_model() must be called first")
        return self.model

    def kv_cache_spec(self, kv_cache_dtype: torch.dtype) -> KVCacheSpec:
        layers = attention_layers(self.require_model())
        return KVCacheSpec(
            block_size=self.block_size,
            num_kv_heads=[layer.num_kv_heads for layer in layers.values()],
            head_size=[layer.head_size for layer in layers.values()],
            dtype=kv_cache_dtype,
        )

    def initialize_kv_cache(self, num_blocks: int, kv_cache_dtype: torch.dtype) -> None:
        """The drafter's cache tensors, `num_blocks` blocks each like the target's (same block ids)."""
        model = self.require_model()
        spec = self.kv_cache_spec(kv_cache_dtype)
        backend = get_attn_backend()
        self.kv_caches = [
            allocate_zeroed(
                backend.get_kv_cache_shape(num_blocks, self.block_size, heads, size), kv_cache_dtype, self.device
            )
            for heads, size in zip(spec.num_kv_heads, spec.head_size)
        ]
        bind_kv_cache(model, self.kv_caches)
        self.builder = backend.get_builder_cls()(attention_layers(model).values(), self.dtype, self.device)
        # The cache was (re)allocated: nothing in it is valid any more.
        self.reset()

    def release_kv_cache(self) -> int:
        """Free the cache tensors (sleep mode); returns their bytes. `initialize_kv_cache` restores them."""
        model = self.require_model()
        released = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self.kv_caches = []
        bind_kv_cache(model, [torch.empty(0, device=self.device)] * len(attention_layers(model)))
        self.reset()
        return released

    def reset(self) -> None:
        """Forget every request's cache state."""

    def observe(self, step: TargetStep) -> None:
        """A draft model runs on the request's tokens alone."""

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None:
        """A finished or preempted request (a preempted one resumes in other blocks: its cache is gone)."""
        self.draft_probs.pop(req_id, None)

    def run(
        self,
        batch: DraftBatch,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        token_shift: int = 0,
        *extra: torch.Tensor,
    ) -> torch.Tensor:
        """Run positions [starts[i], ends[i]) of each batch row through the drafter, reading each
        position's token from the row `token_shift` places further on (EAGLE reads the next token);
        `extra` are further per-token inputs. Returns the model's output rows."""
        model = self.require_model()
        num_sched = ends - starts
        qsl = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(num_sched, out=qsl[1:])
        total = int(qsl[-1])
        tok_row = np.repeat(rows, num_sched)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - starts, num_sched)
        input_ids = batch.token_ids[tok_row, positions + token_shift]
        block_ids = batch.block_table[tok_row, positions // self.block_size].astype(np.int64)
        slots = block_ids * self.block_size + positions % self.block_size
        max_blocks = -(-int(ends.max()) // self.block_size)
        dev = self.device
        common = CommonAttentionMetadata(
            num_actual_tokens=total,
            num_reqs=rows.size,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev),
            num_computed_tokens=torch.from_numpy(starts.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(batch.block_table[rows, :max_blocks]).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(ends.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=ends.tolist(),
        )
        with set_forward_context(self.builder.build(common)):
            return model(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), *extra)

    def sample(self, logits: torch.Tensor, request: DraftRequest) -> tuple[int, torch.Tensor | None]:
        """The next draft token from a row of target-vocabulary logits, and the distribution it was
        drawn from (None: the argmax)."""
        logits = logits[: self.vocab_size].float()
        if self.greedy_drafts or request.temperature <= 0:
            return int(logits.argmax()), None
        q = torch.zeros(self.vocab_size, dtype=torch.float32, device=logits.device)
        q[: logits.numel()] = torch.softmax(logits / request.temperature, dim=-1)
        generators = {0: request.generator} if request.generator is not None else {}
        return int(random_sample(q.clone().unsqueeze(0), generators)[0]), q

    def draft_round(
        self,
        batch: DraftBatch,
        logits: torch.Tensor,
        active: list[DraftRequest],
        depth: int,
        drafts: dict[str, list[int]],
        probs: dict[str, list[torch.Tensor]],
    ) -> list[int]:
        """Sample draft number `depth` of each active request from its logits row (appending to
        `drafts` and `probs`); returns the indices of the requests that draft further, whose new draft
        is then written after the request's tokens in its row, where the next round reads it (the
        runner writes drafts there too; they are not part of the sequence)."""
        keep: list[int] = []
        for i, request in enumerate(active):
            token, q = self.sample(logits[i], request)
            drafts[request.req_id].append(token)
            if q is not None:
                probs[request.req_id].append(q)
            if depth + 1 < request.num_drafts:
                batch.token_ids[request.row, int(batch.num_tokens[request.row]) + depth] = token
                keep.append(i)
        return keep

    def record_probs(self, probs: dict[str, list[torch.Tensor]]) -> None:
        self.draft_probs = {req_id: torch.stack(rows) for req_id, rows in probs.items() if rows}
