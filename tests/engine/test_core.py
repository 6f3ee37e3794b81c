"""EngineCore end to end: scheduler + executor + runner, greedy outputs identical to HF transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
from runner_driver import hf_greedy, make_config, save_tiny_model  # noqa: E402

from pagedllm.config.engine import EngineConfig  # noqa: E402
from pagedllm.engine.core import EngineCore  # noqa: E402
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, FinishReason  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    list(range(5, 25)),
    [100, 101, 102],
    [7 * i % 256 for i in range(1, 41)],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17],
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def hf_tokens(model_dir: Path) -> list[list[int]]:
    return [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS]


def eager_config(model_dir: Path, **kwargs: object) -> EngineConfig:
    """The tiny model's config at optimization level 0: these tests are about the engine core's
    scheduling, and at the default O2 each core's first steps Inductor-compiled the forward (graphs
    against eager are tests/worker/test_compiled_forward.py's subject)."""
    return make_config(model_dir, optimization_level=0, **kwargs)  # type: ignore[arg-type]


def request(
    req_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **params: object
) -> EngineCoreRequest:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return EngineCoreRequest(req_id, prompt, sp, eos_token_id=None)


def run_to_completion(core: EngineCore, max_steps: int = 500) -> tuple[dict[str, list[int]], dict, list]:
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    all_outputs: list[EngineCoreOutputs] = []
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        outs = core.step()
        all_outputs.append(outs)
        for o in outs.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason
    assert not core.has_unfinished_requests()
    return tokens, finish, all_outputs


@pytest.mark.parametrize(
    "cache",
    [
        {"kv_cache_memory_bytes": 2**20},
        # 8 blocks (the minimum for max_model_len=128) for requests needing 16 in all: forces preemption.
        {"num_gpu_blocks_override": 8},
        {"num_gpu_blocks_override": 64, "enable_prefix_caching": False},
    ],
)
@pytest.mark.parametrize("max_num_batched_tokens", [16, 64])
def test_greedy_matches_hf(
    model_dir: Path, hf_tokens: list[list[int]], cache: dict, max_num_batched_tokens: int
) -> None:
    core = EngineCore(eager_config(model_dir, max_num_batched_tokens=max_num_batched_tokens, **cache))
    try:
        for i, p in enumerate(PROMPTS):
            core.add_request(request(str(i), p))
        tokens, finish, outputs = run_to_completion(core)
        assert tokens == {str(i): t for i, t in enumerate(hf_tokens)}
        assert finish == {str(i): FinishReason.LENGTH for i in range(len(PROMPTS))}
        preemptions = sum(o.scheduler_stats.num_preemptions for o in outputs if o.scheduler_stats)
        assert (preemptions > 0) == (cache.get("num_gpu_blocks_override") == 8)
    finally:
        core.shutdown()


def test_prefix_cache_hits_give_the_same_tokens(model_dir: Path) -> None:
    shared = PROMPTS[2][:32]  # two full blocks
    prompts = [shared + [1, 2, 3], shared + [200, 201]]
    want = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    core = EngineCore(eager_config(model_dir, num_gpu_blocks_override=32))
    try:
        core.add_request(request("first", prompts[0]))
        first, _, _ = run_to_completion(core)
        core.add_request(request("second", prompts[1]))
        second, _, outputs = run_to_completion(core)
        assert [first["first"], second["second"]] == want
        assert sum(o.scheduler_stats.prefix_cache_hits for o in outputs if o.scheduler_stats) == 32
    finally:
        core.shutdown()


def test_kv_cache_sizing(model_dir: Path) -> None:
    cfg = eager_config(model_dir, kv_cache_memory_bytes=2**20)
    core = EngineCore(cfg)
    bytes_per_block = core.model_executor.collective_rpc("get_kv_cache_spec")[0].bytes_per_block
    assert cfg.cache_config.num_gpu_blocks == 2**20 // bytes_per_block
    core.shutdown()

    cfg = eager_config(model_dir, kv_cache_memory_bytes=2**20, num_gpu_blocks_override=9)
    core = EngineCore(cfg)
    assert cfg.cache_config.num_gpu_blocks == 9
    assert core.model_executor.driver_worker.runner.kv_caches[0].shape[1] == 9
    core.shutdown()


def test_cache_too_small_for_one_sequence(model_dir: Path) -> None:
    # max_model_len=128 needs 8 blocks of 16 tokens.
    with pytest.raises(ValueError, match=r"needs 8 blocks.*max_model_len"):
        EngineCore(eager_config(model_dir, num_gpu_blocks_override=7))


def test_admission_error_is_reported_not_raised(model_dir: Path, hf_tokens: list[list[int]]) -> None:
    core = EngineCore(eager_config(model_dir, kv_cache_memory_bytes=2**20))
    try:
        core.add_request(request("too-long", [1] * 200))  # max_model_len is 128
        core.add_request(request("ok", PROMPTS[1]))
        core.add_request(request("empty", []))
        core.add_request(request("bad-id", [5, 256]))  # vocab_size is 256
        core.add_request(request("ok", PROMPTS[2]))  # duplicate id
        tokens, _, outputs = run_to_completion(core)
        errors = [(k, v) for o in outputs for k, v in o.errors.items()]
        assert [k for k, _ in errors] == ["too-long", "empty", "bad-id", "ok"]
        assert "128" in errors[0][1].message and "empty" in errors[1][1].message
        assert "256" in errors[2][1].message and "already" in errors[3][1].message
        # The prompt is at fault in the first three (the field travels with the message); no one field
        # is in a duplicate id.
        assert [e.param for _, e in errors] == ["prompt", "prompt", "prompt", None]
        assert tokens == {"ok": hf_tokens[1]}
    finally:
        core.shutdown()


def test_abort_frees_the_request(model_dir: Path, hf_tokens: list[list[int]]) -> None:
    core = EngineCore(eager_config(model_dir, num_gpu_blocks_override=16))
    try:
        core.add_request(request("a", PROMPTS[0], max_tokens=1000 - len(PROMPTS[0])))
        core.add_request(request("b", PROMPTS[2]))
        for _ in range(3):
            core.step()
        core.abort_requests(["a"])
        tokens, finish, _ = run_to_completion(core)
        assert "a" not in finish
        assert tokens["b"] == hf_tokens[2][len(hf_tokens[2]) - len(tokens["b"]) :]
        assert core.scheduler.kv_cache_manager.usage == 0
        assert core.reset_prefix_cache()
    finally:
        core.shutdown()


@pytest.mark.slow
def test_smollm2_chat_prompts_match_hf(smollm2_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    from pagedllm.config.model import ModelConfig
    from pagedllm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(smollm2_gguf)
    questions = [
        "What is the capital of France?",
        "Write a haiku about rain.",
        "Count to five.",
        "Who are you?",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    # transformers 5 returns a BatchEncoding here, older versions a list.
    prompts = [list(p) if isinstance(p, list) else list(p["input_ids"]) for p in prompts]
    n = 32
    cfg = EngineConfig(model_config=ModelConfig(model=str(smollm2_gguf), dtype="float32", max_model_len=256))
    cfg.cache_config.kv_cache_memory_bytes = 64 * 2**20
    eos = cfg.model_config.eos_token_id
    core = EngineCore(cfg)
    try:
        for i, p in enumerate(prompts):
            sp = SamplingParams(temperature=0.0, max_tokens=n)
            core.add_request(EngineCoreRequest(str(i), p, sp, eos_token_id=eos))
        tokens, _, _ = run_to_completion(core)
    finally:
        core.shutdown()

    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    for i, p in enumerate(prompts):
        # Both sides stop at EOS (included in the output) or after n tokens.
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos
        )
        assert tokens[str(i)] == out[0, len(p) :].tolist(), f"prompt {i}"
