"""EAGLE speculative decoding (``speculative_config.method`` "eagle" and "eagle3"): a one-layer draft
head fed the target's hidden states proposes k tokens; the target verifies them in its next forward
(`worker/spec_decode.py`). An EAGLE-1 head (`models/llama_eagle.py`) reads the target's final hidden
states and drafts through the target's LM head; an EAGLE-3 head (`models/llama_eagle3.py`) reads the
residual streams entering three target layers (captured by forward pre-hooks, so the target runs
eagerly) and has its own small-vocabulary LM head.

The head keeps a paged KV cache in the target's blocks (`worker/model_drafter.py`). Its entry at
position i is computed from token i + 1 and the target's hidden state at i, which exist only in the
step where the target computed position i: so after EVERY step (drafting or not, mid-prefill chunks
included) the head runs each scheduled request's positions whose next token is now known (a prefill
chunk's all, a verification's accepted drafts plus the last token, up to the one before the
request's newest token). The last of those rows yields the first draft; each further draft runs one
position more, the head's own output standing in for the target's hidden state. Those draft
positions are run again by the target, and so by the head, in the next step.

A block shared through the prefix cache holds the head's entries of the request that computed it; the
entry at the block's last position was computed from the next token of THAT request (the block hash
does not cover it), so a request diverging right after a shared block may draft slightly worse
there - never wrongly, the target verifies every draft.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama_eagle import EagleHead, EagleLlamaDraft
from pagedllm.models.llama_eagle3 import Eagle3LlamaDraft, aux_layer_ids
from pagedllm.models.loader import ModelLoadError, default_dtype
from pagedllm.models.loader.safetensors_loader import iterate_safetensors, read_header, safetensors_files
from pagedllm.models.loader.weights import load_weights
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_drafter import DraftRequest, ModelDrafter

logger = logging.getLogger("pagedllm.worker")


@dataclass
class TargetStep:
    """What the target's last step computed: its requests (batch order), their rows, cumulative query
    lengths, tokens in the cache before the step, and the final hidden state of every token."""

    req_ids: list[str]
    rows: np.ndarray
    query_start_loc: np.ndarray
    num_computed: np.ndarray
    hidden: torch.Tensor


class EagleProposer(ModelDrafter):
    def __init__(self, engine_config: Any) -> None:
        super().__init__(engine_config)
        # Draft logits in the target's vocabulary from the head's output.
        self.compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.step: TargetStep | None = None
        # EAGLE-3: the residual stream entering each auxiliary target layer in the last forward.
        self.aux_layers: list[int] = []
        self.aux_hidden: dict[int, torch.Tensor] = {}

    def load_model(self, target: nn.Module) -> None:
        """Load the head from its checkpoint; it shares the target's LM head (and its embedding when
        the checkpoint has none)."""
        # Imported here: pagedllm.config imports the worker's siblings through the model registry.
        from pagedllm.config import ModelConfig

        cfg = self.engine_config
        spec = cfg.speculative_config
        head_config = ModelConfig(model=spec.model, dtype=self.dtype, skip_tokenizer_init=True)
        spec.draft_model_config = head_config
        spec.target_model_config = cfg.model_config
        hf = head_config.hf_config
        if hf.hidden_size != cfg.model_config.get_hidden_size():
            raise ModelLoadError(
                f"EAGLE head {spec.model} has hidden size {hf.hidden_size}, the target "
                f"{cfg.model_config.get_hidden_size()}: it was trained for another model"
            )
        files = safetensors_files(head_config.model_path)
        names = {name for path in files for name in read_header(path)[0]}
        own_embedding = "embed_tokens.weight" in names
        head: EagleHead
        with torch.device(self.device), default_dtype(self.dtype):
            if spec.method == "eagle3":
                head = Eagle3LlamaDraft(hf, own_embedding)
            else:
                head = EagleLlamaDraft(hf, fc_bias="fc.bias" in names, own_embedding=own_embedding)
        head.to(device=self.device)
        for module in head.modules():
            if isinstance(module, RotaryEmbedding):
                module.cover_positions(cfg.model_config.max_model_len)
        with torch.no_grad():
            load_weights(head, iterate_safetensors(files))
        head.share_embedding(target.get_submodule("model.embed_tokens"))
        self.model = head.eval()
        if isinstance(head, Eagle3LlamaDraft):
            self.compute_logits = head.compute_logits
            self._capture_aux_hidden(target, aux_layer_ids(hf, cfg.model_config.get_total_num_layers()))
        else:
            self.compute_logits = target.compute_logits
        logger.info("loaded %s head %s (%d layers)", spec.method, spec.model, hf.num_hidden_layers)

    def _capture_aux_hidden(self, target: nn.Module, layer_ids: list[int]) -> None:
        layers = target.get_submodule("model.layers")
        if not all(0 <= i < len(layers) for i in layer_ids):
            raise ModelLoadError(f"EAGLE-3 auxiliary layers {layer_ids} are not all among the target's {len(layers)}")
        self.aux_layers = layer_ids
        for i in dict.fromkeys(layer_ids):

            def capture(module: nn.Module, args: tuple[Any, ...], layer: int = i) -> None:
                # A decoder layer's input: (positions, hidden, residual); the stream is their sum.
                _, hidden, residual = args
                self.aux_hidden[layer] = hidden if residual is None else hidden + residual

            layers[i].register_forward_pre_hook(capture)

    def observe(self, step: TargetStep) -> None:
        if self.aux_layers:
            step.hidden = torch.cat([self.aux_hidden[i] for i in self.aux_layers], dim=-1)
        self.step = step

    @torch.inference_mode()
    def propose(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, list[int]]:
        step, self.step = self.step, None
        self.draft_probs = {}
        if step is None:
            return {}
        assert self.compute_logits is not None
        rows, starts, ends, hidden_rows = self._catch_up_ranges(batch, step)
        if not rows:
            return {}
        rows_np, ends_np = np.asarray(rows), np.asarray(ends)
        features = self.run(
            batch, rows_np, np.asarray(starts), ends_np, 1, step.hidden.index_select(0, hidden_rows.to(step.hidden.device))
        )
        # Each catch-up run's last row: the feature that predicts the token after the request's newest.
        last = np.cumsum(ends_np - np.asarray(starts)) - 1
        last_row = {row: int(last[i]) for i, row in enumerate(rows) if ends[i] == batch.num_tokens[row] - 1}
        active = [r for r in requests if r.num_drafts > 0 and r.row in last_row]
        drafts: dict[str, list[int]] = {r.req_id: [] for r in active}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r in active}
        if not active:
            return drafts
        features = features.index_select(0, torch.tensor([last_row[r.row] for r in active], device=features.device))
        for depth in range(max(r.num_drafts for r in active)):
            keep = self.draft_round(batch, self.compute_logits(features), active, depth, drafts, probs)
            if not keep:
                break
            active = [active[i] for i in keep]
            positions = np.asarray([int(batch.num_tokens[r.row]) - 1 + depth for r in active], dtype=np.int64)
            features = self.run(
                batch,
                np.asarray([r.row for r in active], dtype=np.int64),
                positions,
                positions + 1,
                1,
                features.index_select(0, torch.tensor(keep, device=features.device)),
            )
        self.record_probs(probs)
        return drafts

    @staticmethod
    def _catch_up_ranges(
        batch: InputBatch, step: TargetStep
    ) -> tuple[list[int], list[int], list[int], torch.Tensor]:
        """Per request of the step: its row and the positions [start, end) the head runs now (those the
        target computed whose next token is known), and the rows of the target's hidden states."""
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        hidden_rows: list[np.ndarray] = []
        for j, req_id in enumerate(step.req_ids):
            row = int(step.rows[j])
            if batch.req_id_to_row.get(req_id) != row:
                continue
            start = int(step.num_computed[j])
            end = min(start + int(step.query_start_loc[j + 1] - step.query_start_loc[j]), int(batch.num_tokens[row]) - 1)
            if end <= start:
                continue
            rows.append(row)
            starts.append(start)
            ends.append(end)
            hidden_rows.append(np.arange(end - start) + int(step.query_start_loc[j]))
        index = np.concatenate(hidden_rows) if hidden_rows else np.zeros(0, dtype=np.int64)
        return rows, starts, ends, torch.from_numpy(index)
