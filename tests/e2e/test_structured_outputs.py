"""Structured outputs end to end on the embedded SmolLM2-135M-Instruct, sampling at temperature 1.0 (where
the model would otherwise stray): every output of a nested JSON schema validates, regex, choice and GBNF
outputs match, a seeded constrained request gives the same tokens on a prefix-cache hit, without prefix
caching and unchunked, and when preempted and recomputed (batch-invariant mode), n > 1 children each
follow their grammar up to a stop string, and a bad schema is refused alone while the good requests
beside it finish."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.chat_template import apply_chat_template
from pagedllm.config.args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["new", "vip"]}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "integer", "minimum": 0},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role", "address"],
}
PROMPT = [{"role": "user", "content": "Describe a user of a web site as JSON."}]
# A tiny arithmetic language, in xgrammar's GBNF.
GRAMMAR = 'root ::= num (op num){0,2}\nop ::= "+" | "-" | "*"\nnum ::= [1-9] [0-9]?'


def params(seed: int, max_tokens: int = 120, **constraint: object) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)


# A short record whose compact JSON is ~20 tokens: cheap to generate several times.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "kind": {"enum": ["town", "capital"]},
    },
    "required": ["city", "stars", "kind"],
}
# 32-token chunks split every prompt.
ENGINE = {"max_model_len": 512, "optimization_level": 0, "max_num_batched_tokens": 32, "dtype": "float32"}


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # Batch invariance makes a prefix hit, another chunking or a recompute after preemption bitwise the
    # same as the first run (sampling at temperature 1 would otherwise amplify float summation-order
    # differences). It stays set for the module: the other engines below are built under it too.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_BATCH_INVARIANT", "1")
        yield LLM(kv_cache_memory_bytes=64 << 20, **ENGINE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def small_requests(llm: LLM) -> list[tuple[dict, SamplingParams]]:
    """Two seeded SMALL_SCHEMA requests as token prompts (any engine takes them as they are)."""
    tokenizer = llm.get_tokenizer()
    cities = ["France", "Peru"]
    requests = []
    for seed, country in enumerate(cities):
        text = apply_chat_template(
            tokenizer,
            [{"role": "user", "content": f"Rate a city of {country} as JSON."}],
            add_generation_prompt=True,
        )
        prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        requests.append((prompt, params(seed, 40, json=SMALL_SCHEMA, disable_any_whitespace=True)))
    return requests


def run_engine(engine: LLMEngine, requests: list[tuple[dict, SamplingParams]]) -> tuple[list[list[int]], int]:
    """Each request's output tokens (checked to validate), and the preemptions seen on the way."""
    for i, (prompt, sampling) in enumerate(requests):
        engine.add_request(str(i), prompt, sampling)
    tokens: dict[str, list[int]] = {}
    preemptions = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                assert completion.finish_reason == "stop", completion.text
                jsonschema.validate(json.loads(completion.text), SMALL_SCHEMA)
                tokens[output.request_id] = list(completion.token_ids)
        if engine.scheduler_stats is not None:
            preemptions += engine.scheduler_stats.num_preemptions
    return [tokens[str(i)] for i in range(len(requests))], preemptions


@pytest.fixture(scope="module")
def reference(llm: LLM, small_requests: list[tuple[dict, SamplingParams]]) -> list[list[int]]:
    """The module engine's outputs (prefix caching on, 32-token chunks, ample KV)."""
    tokens, preemptions = run_engine(llm.llm_engine, small_requests)
    assert preemptions == 0
    return tokens


def test_nested_json_schema_outputs_validate(llm: LLM) -> None:
    # Compact JSON keeps the outputs short (the runtime is the model's, on 2 shared cores).
    outputs = llm.chat(
        [PROMPT] * 2,
        [params(seed, 90, json=SCHEMA, disable_any_whitespace=True) for seed in range(2)],
        use_tqdm=False,
    )
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(llm: LLM) -> None:
    constraints: list[dict] = [
        {"regex": r"[A-Z][a-z]{2,6}-[0-9]{3}"},
        {"choice": ["Paris", "London", "a city I do not know"]},
        {"grammar": GRAMMAR},
    ]
    prompts = [[{"role": "user", "content": "Name a city and a number."}]] * 3
    outputs = llm.chat(prompts, [params(7, 24, **c) for c in constraints], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", texts[0]), texts[0]
    assert texts[1] in constraints[1]["choice"]
    assert re.fullmatch(r"[1-9][0-9]?([-+*][1-9][0-9]?){0,2}", texts[2]), texts[2]


def test_same_output_on_a_prefix_cache_hit(llm: LLM) -> None:
    request = params(11, 12, regex=r"[A-Z][a-z]{3,20}")
    prompt = [{"role": "user", "content": "Which city would you like to visit next summer, and why? JSON."}]
    cold = llm.chat([prompt], request, use_tqdm=False)[0]
    hit = llm.chat([prompt], request, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids


def test_bad_schema_is_refused_before_it_is_queued(llm: LLM) -> None:
    with pytest.raises(ValueError, match="structured_outputs.json is invalid"):
        llm.chat([PROMPT] * 2, [params(0, json=SCHEMA), params(1, json={"type": "objekt"})], use_tqdm=False)
    # Nothing of the refused batch was left in the engine; the next request runs normally.
    (output,) = llm.chat([PROMPT], params(2, 16, choice=["yes", "no"]), use_tqdm=False)
    assert output.outputs[0].text in ("yes", "no")


def test_same_outputs_on_a_prefix_hit_and_without_prefix_caching_or_chunking(
    llm: LLM, small_requests: list[tuple[dict, SamplingParams]], reference: list[list[int]]
) -> None:
    hit, _ = run_engine(llm.llm_engine, small_requests)
    assert hit == reference
    # Prefix caching off and the whole prompt in one step (the default budget).
    args = EngineArgs(
        **{**ENGINE, "max_num_batched_tokens": 2048},  # type: ignore[arg-type]
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,
    )
    plain, _ = run_engine(LLMEngine.from_engine_args(args), small_requests)
    assert plain == reference


def test_same_outputs_when_preempted_and_recomputed(
    small_requests: list[tuple[dict, SamplingParams]], reference: list[list[int]]
) -> None:
    # 6 blocks of 16 tokens hold one of the two ~60-token sequences: the other is preempted and
    # recomputes its prompt and outputs (16-token chunks) while its matcher keeps its state.
    args = EngineArgs(
        **{**ENGINE, "max_model_len": 96, "max_num_batched_tokens": 16},  # type: ignore[arg-type]
        num_gpu_blocks_override=6,
        enable_prefix_caching=False,
    )
    tokens, preemptions = run_engine(LLMEngine.from_engine_args(args), small_requests)
    assert preemptions > 0, "the KV budget was meant to force preemption"
    assert tokens == reference


def test_n_children_follow_the_grammar_up_to_a_stop_string(llm: LLM) -> None:
    constraint = {"json": SMALL_SCHEMA, "disable_any_whitespace": True}
    sampling = SamplingParams(
        n=2, stop=['"kind"'], temperature=1.0, seed=5, max_tokens=40, structured_outputs=constraint
    )
    (output,) = llm.chat([PROMPT], sampling, use_tqdm=False)
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert completion.finish_reason == "stop" and completion.stop_reason == '"kind"', completion.text
        # Cut before the last property: completing it must give a valid object.
        jsonschema.validate(json.loads(completion.text + '"kind":"town"}'), SMALL_SCHEMA)


def test_bad_schema_fails_alone_among_good_requests(
    llm: LLM, small_requests: list[tuple[dict, SamplingParams]], reference: list[list[int]]
) -> None:
    engine = llm.llm_engine
    prompt, _ = small_requests[0]
    engine.add_request("good-0", *small_requests[0])
    with pytest.raises(ValueError, match="structured_outputs.json is invalid"):
        engine.add_request("bad", prompt, params(0, json={"type": "object", "required": "city"}))
    engine.add_request("good-1", *small_requests[1])
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert finished == {"good-0": reference[0], "good-1": reference[1]}
