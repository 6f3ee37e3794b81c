"""The offline API on a tiny random Llama with a real tokenizer: prompt forms, ordering, chat, greedy vs HF."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_llm import hf_greedy, make_tiny_llm
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.config.args import EngineArgs
from pagedllm.engine.input_processor import InputProcessor
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


def test_generation_stops_at_max_model_len(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    # max_model_len is 256: a 253-token prompt leaves room for exactly 3 output tokens.
    prompt = (tokenizer.encode("Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. ") * 40)[:253]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3 and output.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens=4 is too large"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4), use_tqdm=False)


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
    tokenizer = llm.get_tokenizer()
    # Two full blocks of 16 tokens and a bit: a repeat can be served from the prefix cache.
    prompt = {"prompt_token_ids": tokenizer.encode("Paged attention reset test. " * 6)[:40]}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    (again,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    (after_reset,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert after_reset.num_cached_tokens == 0
    assert after_reset.outputs[0].token_ids == again.outputs[0].token_ids


def test_progress_bar_counts_requests_and_tokens_per_second(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and f"{len(PROMPTS)}/{len(PROMPTS)}" in err
    assert re.search(r"input: \d+\.\d toks/s, output: \d+\.\d toks/s", err), err
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_generation_config_defaults(model_dir: Path, tmp_path: Path) -> None:
    """The model's generation_config.json decides what the user leaves unset."""
    gen_dir = tmp_path / "with_generation_config"
    shutil.copytree(model_dir, gen_dir)
    gen_file = gen_dir / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    generation.update(temperature=0.0, top_k=5, repetition_penalty=3.0, max_new_tokens=8)
    gen_file.write_text(json.dumps(generation))
    engine_kwargs = dict(dtype="float32", max_model_len=256, enforce_eager=True, optimization_level=0)
    llm = LLM(model=str(gen_dir), **engine_kwargs)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 3.0, 8)

    # This prompt's plain greedy continuation repeats itself within 8 tokens, so the penalty shows.
    prompt = llm.get_tokenizer().encode(PROMPTS[1])
    model = AutoModelForCausalLM.from_pretrained(gen_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        penalized = model.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=3.0)
        plain = model.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=1.0)
    expected = penalized[0, len(prompt) :].tolist()
    assert expected != plain[0, len(prompt) :].tolist(), "the penalty must matter for this test to mean much"
    (output,) = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)
    assert output.outputs[0].token_ids == expected
    # A field the user sets wins; the unset ones still come from the model (greedy, penalized).
    (short,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert short.outputs[0].token_ids == expected[:3]
    # generation_config="vllm" ignores the file: the engine defaults apply.
    config = EngineArgs(model=str(gen_dir), generation_config="vllm", **engine_kwargs).create_engine_config()
    vllm_defaults = InputProcessor(config.model_config, llm.get_tokenizer()).default_sampling_params()
    assert (vllm_defaults.temperature, vllm_defaults.repetition_penalty, vllm_defaults.max_tokens) == (
        1.0,
        1.0,
        16,
    )


def test_max_model_len_past_the_model_maximum(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN lets max_model_len exceed max_position_embeddings; the
    rotary table then covers it, and positions past the model's maximum (here the whole tail of the
    prompt and every generated token) decode as HF computes them."""
    short = tmp_path / "short"
    shutil.copytree(model_dir, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (short / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(model=str(short), dtype="float32", max_model_len=96, enforce_eager=True, optimization_level=0)
    prompt = (llm.get_tokenizer().encode(PROMPTS[2]) * 4)[:48]
    (output,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(short, [prompt], GREEDY.max_tokens)[0]


def test_offline_api_and_engine_do_not_import_the_server() -> None:
    # Layers call down: the offline API, the engine and the configs work without the HTTP server.
    code = (
        "import sys, pagedllm.llm, pagedllm.engine.llm_engine, pagedllm.engine.async_llm, pagedllm.config.args; "
        "print(sorted(m for m in sys.modules if m.startswith('pagedllm.entrypoints')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "[]"


def test_data_parallelism_offline_points_to_the_server(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"not supported offline.*pagedllm serve --data-parallel-size 2"):
        LLM(model=str(model_dir), data_parallel_size=2, max_model_len=256, optimization_level=0)
