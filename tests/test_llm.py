"""The offline API on a tiny random Llama with a real tokenizer: prompt forms, ordering, chat, greedy vs HF."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from e2e.tiny_llm import hf_greedy, make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

PROMPTS = [
    "The quick brown fox",
    "Hello, world!",
    "Paged attention stores keys and values in fixed-size blocks. Continuous batching",
    "0 1 2 3",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(
        model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True, optimization_level=0
    )


def test_greedy_matches_transformers(llm: LLM, model_dir: Path) -> None:
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = hf_greedy(model_dir, [tokenizer.encode(p) for p in PROMPTS], GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output, prompt in zip(outputs, PROMPTS):
        completion = output.outputs[0]
        assert output.finished and output.prompt == prompt
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")


def test_outputs_in_input_order_and_prompt_forms(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    forward = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # Reversed order, and each prompt as a token-ids dict: the same completions, in the new order.
    token_prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in reversed(PROMPTS)]
    backward = llm.generate(token_prompts, GREEDY, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in backward] == [o.outputs[0].token_ids for o in reversed(forward)]
    assert backward[0].prompt is None
    single = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == forward[1].outputs[0].token_ids
    text_dict = llm.generate({"prompt": PROMPTS[1]}, GREEDY, use_tqdm=False)
    assert text_dict[0].outputs[0].token_ids == forward[1].outputs[0].token_ids


def test_params_per_prompt_and_user_params_untouched(llm: LLM) -> None:
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:2], [short, long], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    assert short.output_kind == RequestOutputKind.CUMULATIVE and short.max_tokens == 2
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        llm.generate(PROMPTS[:2], [short], use_tqdm=False)


def test_default_sampling_params(llm: LLM) -> None:
    defaults = llm.get_default_sampling_params()
    assert defaults.max_tokens == 16
    outputs = llm.generate(PROMPTS[0], use_tqdm=False)
    assert 1 <= len(outputs[0].outputs[0].token_ids) <= 16


def test_bad_prompt_aborts_the_whole_call(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt has 300 tokens"):
        llm.generate(["fine", {"prompt_token_ids": [5] * 300}], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # The engine is still usable afterwards.
    assert llm.generate("fine", GREEDY, use_tqdm=False)[0].finished


def test_chat(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    (output,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    expected_prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert output.prompt == expected_prompt
    assert output.prompt_token_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
    (plain,) = llm.generate({"prompt_token_ids": output.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == plain.outputs[0].token_ids
    many = llm.chat([conversation, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False)
    assert len(many) == 2 and many[0].outputs[0].token_ids == output.outputs[0].token_ids
    (no_prompt,) = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert not no_prompt.prompt.endswith("<|im_start|>assistant\n")
    (custom,) = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template="{{ messages[-1].content }}:")
    assert custom.prompt == "Hello:"


def test_logprobs_match_transformers(llm: LLM, model_dir: Path) -> None:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    completion = output.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + completion.token_ids])
        reference = model(ids).logits[0].log_softmax(-1)
    n = len(prompt)
    total = 0.0
    for step, (token, row) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = reference[n - 1 + step]
        top = expected.topk(3)
        assert set(row) == {token, *top.indices.tolist()}
        assert math.isclose(row[token].logprob, expected[token].item(), abs_tol=1e-4)
        assert row[token].rank == 1  # greedy picks the most likely token
        assert row[token].decoded_token == tokenizer.decode([token])
        total += row[token].logprob
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-6)
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == n and prompt_logprobs[0] is None
    for position in range(1, n):
        row = prompt_logprobs[position]
        assert row is not None
        assert math.isclose(
            row[prompt[position]].logprob, reference[position - 1, prompt[position]].item(), abs_tol=1e-4
        )


def test_reset_prefix_cache(llm: LLM) -> None:
    assert llm.reset_prefix_cache() is True
