"""Structured outputs end to end on the embedded SmolLM2-135M-Instruct, sampling at temperature 1.0 (where
the model would otherwise stray): every output of a nested JSON schema validates, regex, choice and GBNF
outputs match, a seeded constrained request is the same on a prefix-cache hit (batch-invariant mode,
prompts prefilled in chunks), and a bad schema is refused alone before it is queued."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams

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


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # Batch invariance makes a prefix hit bitwise the same as the cold run (sampling at temperature 1
    # would otherwise amplify float summation-order differences); 32-token chunks split every prompt.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_BATCH_INVARIANT", "1")
        yield LLM(
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
            optimization_level=0,
            max_num_batched_tokens=32,
            dtype="float32",
        )


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
