"""End to end on the embedded SmolLM2-135M-Instruct (Q4_1 GGUF): greedy chat replies, computed with
chunked prefill, equal transformers' on the same dequantized weights; a second pass served from the
prefix cache gives the same tokens; chat produces text. (The tiny-model tests cover the other engine
settings; this module keeps to one engine to stay quick.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

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
ENGINE: dict[str, Any] = dict(
    max_model_len=512, kv_cache_memory_bytes=64 << 20, optimization_level=0, max_num_batched_tokens=24
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
