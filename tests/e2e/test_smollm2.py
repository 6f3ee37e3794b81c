"""End to end on the embedded SmolLM2-135M-Instruct (Q4_1 GGUF): greedy chat replies, computed with
chunked prefill, equal transformers' on the same dequantized weights; a second pass served from the
prefix cache gives the same tokens; chat produces text; and a second engine (no prefix caching,
another chunk size, a KV cache small enough to force preemption) gives the same tokens in a batch of
64 as the first engine does for the requests one at a time. (The tiny-model tests sweep the engine
settings more widely; this module keeps to two engines to stay quick.)"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.config.args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "user", "content": "Give me three tips for learning a new language."}],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a haiku about a robot learning to paint."}],
]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# Chunks of 24 tokens: every prompt (~40 tokens) is prefilled in pieces, mixed with other requests' decodes.
# float32 like the reference: in bfloat16 (the default on CPUs with native bf16) a near-tie between two
# tokens may fall either way depending on summation order, so exact token equality would be luck.
ENGINE: dict[str, Any] = dict(
    max_model_len=512,
    kv_cache_memory_bytes=64 << 20,
    optimization_level=0,
    max_num_batched_tokens=24,
    dtype="float32",
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # No model argument: the embedded default.
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def replies(llm: LLM) -> list[Any]:
    return llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)


def test_greedy_chat_equals_transformers(replies: list[Any], smollm2_gguf: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        for output in replies:
            prompt = torch.tensor([output.prompt_token_ids])
            expected = model.generate(prompt, max_new_tokens=MAX_TOKENS, do_sample=False)[
                0, prompt.shape[1] :
            ]
            assert output.outputs[0].token_ids == expected.tolist()


def test_chat_produces_text(llm: LLM, replies: list[Any]) -> None:
    tokenizer = llm.get_tokenizer()
    for output in replies:
        completion = output.outputs[0]
        assert output.prompt.endswith("<|im_start|>assistant\n")
        assert completion.text.strip()
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_prefix_cache_hits_keep_outputs(llm: LLM, replies: list[Any]) -> None:
    again = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in replies]
    # SmolLM2's template opens every conversation with the same system prompt (unless one is given).
    assert all(o.num_cached_tokens > 0 for o in again)


def test_batch_of_64_without_prefix_cache_under_preemption(llm: LLM, replies: list[Any]) -> None:
    # 20 blocks of 16 tokens for 64 requests: they cannot all grow at once, so requests are preempted
    # (about seven times) and recomputed, without prefix caching from scratch; steps of 64 tokens, not
    # 24 (the chat prompts are chunked at other places).
    args = EngineArgs(
        **{**ENGINE, "max_model_len": 128, "max_num_batched_tokens": 64},
        enable_prefix_caching=False,
        num_gpu_blocks_override=20,
    )
    engine = LLMEngine.from_engine_args(args)
    tokenizer = engine.get_tokenizer()
    rng = random.Random(0)
    words = "sky river paint robot language light blue learn write three tips haiku".split()
    # 10-15 prompt tokens + 6 outputs: many requests cross into a second block while decoding.
    short: list[list[int]] = []
    while len(short) < 64 - len(replies):
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(rng.randrange(6, 16))))
        if 10 <= len(ids) <= 15:
            short.append(ids)
    batch = [o.prompt_token_ids for o in replies] + short
    for i, ids in enumerate(batch):
        engine.add_request(str(i), {"prompt_token_ids": ids}, GREEDY)
    tokens: dict[str, list[int]] = {}
    preemptions = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        if engine.scheduler_stats is not None:
            preemptions += engine.scheduler_stats.num_preemptions
    engine.shutdown()
    assert preemptions > 0, "the KV budget was meant to force preemption"
    # The chat replies (batch of 3 on the first engine, checked against transformers) ...
    assert [tokens[str(i)] for i in range(len(replies))] == [o.outputs[0].token_ids for o in replies]
    # ... and a sample of the short prompts run one at a time on the first engine.
    for i in (len(replies), 20, 63):
        (alone,) = llm.generate({"prompt_token_ids": batch[i]}, GREEDY, use_tqdm=False)
        assert tokens[str(i)] == alone.outputs[0].token_ids
