"""EAGLE speculative decoding through the offline stack: EAGLE-1 and EAGLE-3 heads written here in the
layouts the published checkpoints use on tiny random Llama targets. Greedy outputs are token-for-token
those of the engine without speculation (prefix caching on and off, chunked prefill, preemption), and
every proposal is what the head computes from scratch with transformers' own Llama modules on the
target's hidden states (the bookkeeping check: a wrong position, a stale cache entry or a hidden state
of the wrong token would change it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from proposal_recorder import record_proposals
from safetensors.torch import load_file, save_file
from tiny_llm import make_tiny_llm
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from pagedllm import LLM, SamplingParams
from pagedllm.worker.compiled_forward import CompiledForward

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello, world! How are you today?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Numbers: 0 1 2 3",
    "Paged attention stores keys",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def eagle_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-1 head for the target: config.json (a one-layer LlamaConfig) and model.safetensors
    with the published names (here with an fc bias and no embedding of its own)."""
    path = tmp_path_factory.mktemp("eagle")
    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.15

    tensors = {
        "fc.weight": rand(h, 2 * h),
        "fc.bias": rand(h),
        "layers.0.self_attn.q_proj.weight": rand(h, h),
        "layers.0.self_attn.k_proj.weight": rand(kv, h),
        "layers.0.self_attn.v_proj.weight": rand(kv, h),
        "layers.0.self_attn.o_proj.weight": rand(h, h),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
        "layers.0.post_attention_layernorm.weight": 1 + rand(h),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _llm(target: Path, eagle: Path | None = None, method: str = "eagle", **kwargs: Any) -> LLM:
    if eagle is not None:
        kwargs["speculative_config"] = {"method": method, "model": str(eagle), "num_speculative_tokens": 3}
    kwargs.setdefault("enforce_eager", True)
    return LLM(model=str(target), dtype="float32", max_model_len=128, **kwargs)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(target_dir: Path) -> list[list[int]]:
    return _tokens(_llm(target_dir).generate(PROMPTS, GREEDY, use_tqdm=False))


class _HeadReference:
    """The EAGLE-1 head from scratch: transformers' Llama target and decoder layer, full recompute."""

    def __init__(self, target_dir: Path, eagle_dir: Path) -> None:
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        config = LlamaConfig.from_pretrained(eagle_dir)
        self.layer = LlamaDecoderLayer(config, layer_idx=0).eval()
        self.layer.input_layernorm = torch.nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)
        weights = load_file(str(eagle_dir / "model.safetensors"))
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.fc.load_state_dict({"weight": weights["fc.weight"], "bias": weights["fc.bias"]})
        self.layer.load_state_dict(
            {k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")}, strict=False
        )

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor([tokens])
        hidden = self.target.model(ids).last_hidden_state[0, :-1]  # h_0 .. h_{n-2} (post-norm)
        next_tokens = list(tokens[1:])
        out: list[int] = []
        for _ in range(k):
            embeds = self.target.model.embed_tokens(torch.tensor(next_tokens))
            x = self.fc(torch.cat([embeds, hidden], dim=-1))[None]
            positions = torch.arange(x.shape[1])[None]
            y = self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))
            feature = (y[0] if isinstance(y, tuple) else y)[0, -1]
            token = int(self.target.lm_head(feature).argmax())
            out.append(token)
            next_tokens.append(token)
            hidden = torch.cat([hidden, feature[None]])
        return out


def _check(llm: LLM, want: list[list[int]], head: Any) -> None:
    """Greedy outputs are `want`, and every proposal is the head's own (recomputed by `head`)."""
    proposals = record_proposals(llm)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert len(proposals) > 20
    mismatched = [(t, d) for t, d in proposals if head.drafts(t, len(d)) != d]
    assert not mismatched, f"{len(mismatched)} of {len(proposals)} proposals differ from the head's own"


ENGINE_KWARGS = {
    "prefix-caching": {"enable_prefix_caching": True},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunk16": {"max_num_batched_tokens": 16, "enable_chunked_prefill": True, "enable_prefix_caching": True},
    "preemption": {"num_gpu_blocks_override": 10, "block_size": 16},
}


@pytest.mark.parametrize("engine", sorted(ENGINE_KWARGS))
def test_greedy_identical_and_drafts_are_the_heads(
    target_dir: Path, eagle_dir: Path, reference: list[list[int]], engine: str
) -> None:
    _check(_llm(target_dir, eagle_dir, **ENGINE_KWARGS[engine]), reference, _HeadReference(target_dir, eagle_dir))


# EAGLE-3 reads the streams entering target layers 2, 3 and 3 (vLLM's default for 6 layers).
DRAFT_VOCAB = 160


@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("deep_target"), num_hidden_layers=6)


@pytest.fixture(scope="module")
def eagle3_dir(deep_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-3 head: config.json with draft_vocab_size, the published tensor names (midlayer.*, fc
    over three hidden states, norm, a small-vocabulary lm_head, d2t / t2d), no embedding of its own."""
    path = tmp_path_factory.mktemp("eagle3")
    config = json.loads((deep_target_dir / "config.json").read_text())
    config.update(num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB, architectures=["LlamaForCausalLMEagle3"])
    (path / "config.json").write_text(json.dumps(config))
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(4)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.15

    kept = torch.randperm(vocab, generator=generator)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(DRAFT_VOCAB, h),
        "d2t": kept - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


class _Head3Reference:
    """The EAGLE-3 head from scratch with transformers' Llama modules, full recompute."""

    def __init__(self, target_dir: Path, eagle_dir: Path) -> None:
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        config = LlamaConfig.from_pretrained(eagle_dir)
        w = {k.removeprefix("midlayer."): v for k, v in load_file(str(eagle_dir / "model.safetensors")).items()}
        wide = LlamaConfig.from_pretrained(eagle_dir)
        wide.head_dim = config.hidden_size // config.num_attention_heads
        wide.hidden_size = 2 * config.hidden_size
        self.attn = LlamaAttention(wide, layer_idx=0).eval()
        self.attn.o_proj = torch.nn.Linear(config.num_attention_heads * wide.head_dim, config.hidden_size, bias=False)
        self.attn.load_state_dict({k.removeprefix("self_attn."): v for k, v in w.items() if k.startswith("self_attn.")})
        self.mlp = LlamaMLP(config).eval()
        self.mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in w.items() if k.startswith("mlp.")})
        self.norms = {}
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
            self.norms[name] = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.norms[name].weight.data.copy_(w[f"{name}.weight"])
        self.fc, self.lm_head, self.d2t = w["fc.weight"], w["lm_head.weight"], w["d2t"]
        self.rotary = LlamaRotaryEmbedding(config)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        streams = self.target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        hidden = torch.cat([streams[i][0, :-1] for i in (2, 3, 3)], dim=-1) @ self.fc.T
        next_tokens = list(tokens[1:])
        out: list[int] = []
        for _ in range(k):
            embeds = self.target.model.embed_tokens(torch.tensor(next_tokens))
            x = torch.cat([self.norms["input_layernorm"](embeds), self.norms["hidden_norm"](hidden)], dim=-1)[None]
            positions = torch.arange(x.shape[1])[None]
            attn = self.attn(x, position_embeddings=self.rotary(x, positions), attention_mask=None)[0][0]
            stream = attn + hidden
            feature = (self.mlp(self.norms["post_attention_layernorm"](stream)) + stream)[-1]
            draft = int((self.norms["norm"](feature) @ self.lm_head.T).argmax())
            token = draft + int(self.d2t[draft])
            out.append(token)
            next_tokens.append(token)
            hidden = torch.cat([hidden, feature[None]])
        return out


@pytest.fixture(scope="module")
def deep_reference(deep_target_dir: Path) -> list[list[int]]:
    return _tokens(_llm(deep_target_dir).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("engine", ["chunk16", "preemption"])
def test_eagle3_greedy_identical_and_drafts_are_the_heads(
    deep_target_dir: Path, eagle3_dir: Path, deep_reference: list[list[int]], engine: str
) -> None:
    llm = _llm(deep_target_dir, eagle3_dir, method="eagle3", **ENGINE_KWARGS[engine])
    _check(llm, deep_reference, _Head3Reference(deep_target_dir, eagle3_dir))


@pytest.mark.slow  # ~1 min on 2 busy cores: Inductor compiles the block and LM head graphs
def test_eagle3_under_the_compiled_forward(
    deep_target_dir: Path, eagle3_dir: Path, deep_reference: list[list[int]]
) -> None:
    """The default -O2 forward (decoder blocks compiled per shape class) returns the auxiliary streams
    too; one-token steps, which the native single-sequence path would take, run the graphs instead."""
    llm = _llm(deep_target_dir, eagle3_dir, method="eagle3", enforce_eager=False, **ENGINE_KWARGS["chunk16"])
    forward = llm.llm_engine.engine_core.core.model_executor.driver_worker.runner._forward
    assert isinstance(forward, CompiledForward) and forward.native is None
    _check(llm, deep_reference, _Head3Reference(deep_target_dir, eagle3_dir))
