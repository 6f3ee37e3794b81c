"""Test helpers: tiny random HF models, engine configs for them, and a driver that feeds a model runner
hand-made `SchedulerOutput`s (a minimal stand-in for the scheduler's bookkeeping: chunking, block
allocation from a shuffled free list, finishing, preemption)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedllm.config.cache import CacheConfig
from pagedllm.config.engine import EngineConfig
from pagedllm.config.model import ModelConfig
from pagedllm.config.scheduler import SchedulerConfig
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    # Peaked logits: random tiny models with the default 0.02 init have near-ties that float
    # summation order could flip, which would make greedy comparisons flaky.
    initializer_range=0.15,
    # No EOS: generation runs to max_tokens on both sides without suppressing any logit.
    eos_token_id=None,
    pad_token_id=0,
)


def save_tiny_model(arch: str, path: Path) -> Path:
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[arch]
    torch.manual_seed(0)
    model_cls(cfg_cls(**TINY)).save_pretrained(path)
    return path


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt])
    # An explicit mask: without one HF masks every prompt token equal to pad_token_id.
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens, "the reference stopped early"
    return tokens


def make_config(
    model_dir: Path,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    optimization_level: int = 2,
    **cache: Any,
) -> EngineConfig:
    """The tiny model's engine config; the default optimization level (O2) compiles the forward with
    Inductor on first use, which runner tests that are not about compilation skip with level 0."""
    return EngineConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=128),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        cache_config=CacheConfig(block_size=16, **cache),
        optimization_level=optimization_level,
    )


@dataclass
class _Req:
    req_id: str
    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    max_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    known: bool = False
    outputs: list[int] = field(default_factory=list)
    # Every step's runner output for this request (to check mid-prefill steps sample nothing).
    history: list[list[int]] = field(default_factory=list)


class RunnerDriver:
    def __init__(
        self, runner: Any, num_blocks: int, block_size: int = 16, chunk_size: int = 10**9, seed: int = 0
    ):
        self.runner = runner
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.outputs: list[ModelRunnerOutput] = []

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, params: SamplingParams | None = None
    ) -> None:
        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.reqs[req_id] = _Req(req_id, list(prompt), len(prompt), params, max_tokens)

    def preempt(self, req_id: str) -> None:
        r = self.reqs[req_id]
        self.free.extend(r.blocks)
        r.blocks, r.num_computed, r.known = [], 0, False
        self.preempted.add(req_id)

    def _alloc(self, r: _Req, total_tokens: int) -> list[int]:
        need = -(-total_tokens // self.block_size) - len(r.blocks)
        new = [self.free.pop() for _ in range(need)]
        r.blocks.extend(new)
        return new

    def step(self, drafts: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """One step. ``drafts`` (req_id -> draft tokens) are scheduled after the last token of the
        decoding requests named, as the scheduler does for speculative decoding; the runner accepts
        none of them yet, so the request advances by its one sampled token."""
        drafts = drafts or {}
        spec: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        sched: dict[str, int] = {}
        for r in self.reqs.values():
            if len(r.outputs) >= r.max_tokens:
                continue
            n = min(len(r.tokens) - r.num_computed, self.chunk_size)
            if r.known and n == 1 and drafts.get(r.req_id):
                spec[r.req_id] = drafts[r.req_id]
                n += len(spec[r.req_id])
            new_blocks = self._alloc(r, r.num_computed + n)
            if not r.known:
                new_reqs.append(
                    NewRequestData(
                        r.req_id, list(r.tokens), r.num_prompt, r.params, list(r.blocks), r.num_computed
                    )
                )
                r.known = True
            else:
                cached.req_ids.append(r.req_id)
                cached.new_block_ids.append(new_blocks)
                cached.num_computed_tokens.append(r.num_computed)
            sched[r.req_id] = n
        so = SchedulerOutput(
            new_reqs, cached, sched, sum(sched.values()), self.finished, self.preempted, spec
        )
        self.finished, self.preempted = set(), set()
        self.runner.execute_model(so)
        out = self.runner.sample_tokens(None)
        self.outputs.append(out)
        for req_id, n in sched.items():
            r = self.reqs[req_id]
            r.num_computed += n - len(spec.get(req_id, ()))
            tokens = out.sampled_token_ids[out.req_id_to_index[req_id]]
            r.history.append(tokens)
            r.outputs += tokens
            r.tokens += tokens
            if len(r.outputs) >= r.max_tokens:
                self.free.extend(r.blocks)
                r.blocks = []
                self.finished.add(req_id)
        return out

    def run(self, max_steps: int = 1000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if all(len(r.outputs) >= r.max_tokens for r in self.reqs.values()):
                break
            self.step()
        return {k: r.outputs for k, r in self.reqs.items()}
