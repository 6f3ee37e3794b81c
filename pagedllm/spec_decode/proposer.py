"""The one interface every drafter implements (`Proposer`), and what the runner hands it.

A proposer is told what the target computed each step (`observe`), asked for the next drafts of the
requests that sampled (`propose`), and told when a request leaves (`forget`); a model-based one keeps
a paged KV cache of its own in the target's blocks (`kv_cache_spec` says what a block holds; None: it
keeps no cache). The runner (`pagedllm.spec_decode.runner`) never asks which method it drives: what
differs between methods is declared here (`shadow_drafts`, `aux_hidden_layers`, `draft_probs`).

spec_decode sits beside `pagedllm.models`, below the worker: the batch is read through `DraftBatch`
(the worker's `InputBatch` is one), and the model-based proposers get their models through the
`DrafterLoaders` the worker passes in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.kv_cache_interface import KVCacheSpec
from pagedllm.sample.row_tokens import TokenRows
from pagedllm.sampling_params import SamplingParams


class DraftBatch(TokenRows, Protocol):
    """The runner's persistent batch as the proposers read it: per row, the request's tokens (drafts
    are written after the last one, outside the sequence), its block table and sampling parameters."""

    req_id_to_row: dict[str, int]
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    block_table: np.ndarray
    sampling_params: list[SamplingParams | None]


@dataclass
class DraftRequest:
    """One request to draft for: its batch row, how many tokens to propose and how many of them the
    target verifies (fewer, down to none for a shadow draft: see `draft_control`), and its sampling
    temperature (0 for greedy drafts) and generator (seeded requests draw from their own)."""

    req_id: str
    row: int
    num_drafts: int
    num_verified: int
    temperature: float
    generator: torch.Generator | None


@dataclass
class TargetStep:
    """What the target's last step computed: its requests (batch order), their rows, cumulative query
    lengths, tokens in the cache before the step, and the hidden state of every token (the auxiliary
    streams side by side when a proposer asked for them: `aux_hidden_layers`)."""

    req_ids: list[str]
    rows: np.ndarray
    query_start_loc: np.ndarray
    num_computed: np.ndarray
    hidden: torch.Tensor


# An EAGLE head loaded for a target: the head, the draft logits of its output (target vocabulary), and
# the target layers whose input streams it reads (EAGLE-3; empty: the final hidden states).
EagleHeadLoad = tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], list[int]]


@dataclass(frozen=True)
class DrafterLoaders:
    """How the model-based proposers get their models (the worker passes `pagedllm.models.drafters`'):
    a draft model `(engine_config, device, dtype)`, an EAGLE head `(engine_config, target, device,
    dtype)`."""

    draft_model: Callable[[EngineConfig, torch.device, torch.dtype], nn.Module]
    eagle_head: Callable[[EngineConfig, nn.Module, torch.device, torch.dtype], EagleHeadLoad]


class Proposer(Protocol):
    # Whether drafting costs no forward: such a proposer is asked every step, also for requests that
    # verify nothing (shadow drafts keep their acceptance history up; see draft_control).
    shadow_drafts: bool
    # The target layers whose input streams the target's forward must return beside its final hidden
    # states (known after `load_model`; empty for all but EAGLE-3).
    aux_hidden_layers: list[int]
    # Per request, the distributions its last drafts were drawn from ([k, vocab]); absent for argmax
    # drafts (a point mass). The rejection sampler needs them for min(1, p / q).
    draft_probs: dict[str, torch.Tensor]

    def load_model(self, target: nn.Module) -> None: ...

    def kv_cache_spec(self, kv_cache_dtype: torch.dtype) -> KVCacheSpec | None: ...

    def initialize_kv_cache(self, num_blocks: int, kv_cache_dtype: torch.dtype) -> None: ...

    def release_kv_cache(self) -> int:
        """Free the cache (sleep mode); returns its bytes."""
        ...

    def observe(self, step: TargetStep) -> None: ...

    def propose(self, batch: DraftBatch, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Up to `num_drafts` drafts per request (the runner verifies the first `num_verified`)."""
        ...

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None:
        """A finished request (with its output) or a preempted one (None): it resumes in other blocks."""
        ...
