"""The structured-output workload of `pagedllm bench throughput --dataset json`.

Every request asks for JSON under one of a few realistic schemas (cycled). The same requests run twice
in one engine: constrained, then unconstrained with each request's `max_tokens` set to the number of
tokens its constrained run produced (and `ignore_eos`), so both runs compute exactly the same tokens in
the same batches and the ratio of their throughputs is the cost of the grammars alone. Grammar compile
time is measured through the engine's StructuredOutputManager: cold (first compile of a schema) and
cached (the same schema again, a cache hit); both runs start with every grammar compiled, after an
untimed unconstrained pass over the same requests that compiles the model's graphs for their shapes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.benchmarks.datasets import SampleRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backends import apply_engine_config
from pagedllm.structured_output.params import StructuredOutputsParams

# (what to generate, its schema): the shapes agents ask for (records with enums, bounds, nesting, lists).
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a user profile",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "maxLength": 40},
                "role": {"enum": ["admin", "editor", "viewer"]},
                "active": {"type": "boolean"},
            },
            "required": ["name", "age", "email", "role", "active"],
        },
    ),
    (
        "a product listing",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "title": {"type": "string", "maxLength": 40},
                "price": {"type": "number", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                "stock": {"type": "integer", "minimum": 0},
            },
            "required": ["sku", "title", "price", "tags", "stock"],
        },
    ),
    (
        "a calendar event",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]},
                "start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 20},
                            "required": {"type": "boolean"},
                        },
                        "required": ["name", "required"],
                    },
                    "maxItems": 3,
                },
            },
            "required": ["title", "day", "start_hour", "attendees"],
        },
    ),
    (
        "a weather tool call",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 30},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    },
                    "required": ["city", "unit", "days"],
                },
            },
            "required": ["name", "arguments"],
        },
    ),
]


def json_requests(num_prompts: int, output_len: int, tokenizer: Any) -> list[SampleRequest]:
    """Chat prompts asking for an example of each schema (cycled), rendered and tokenized."""
    from pagedllm.chat_template import apply_chat_template

    rendered = []
    for what, schema in SCHEMAS:
        content = f"Generate an example of {what} as JSON following this schema:\n{json.dumps(schema)}"
        text = apply_chat_template(
            tokenizer, [{"role": "user", "content": content}], add_generation_prompt=True
        )
        rendered.append((list(tokenizer.encode(text, add_special_tokens=False)), schema))
    return [
        SampleRequest(output_len=output_len, prompt_token_ids=ids, schema=schema)
        for ids, schema in (rendered[i % len(rendered)] for i in range(num_prompts))
    ]


def compile_times(manager: Any) -> dict[str, Any]:
    """Seconds to build the backend (the vocabulary tables, once per engine) and to start the grammar
    compile server process (once per engine), then per schema to compile its grammar cold and again from the
    manager's cache (each with its matcher built)."""
    params = [StructuredOutputsParams(json=schema) for _, schema in SCHEMAS]
    for p in params:
        apply_engine_config(p, manager.config)
    backend = params[0].resolved_backend
    start = time.perf_counter()
    manager.backend(backend)
    backend_init_s = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile_client.start()
    report: dict[str, Any] = {
        "backend": backend,
        "backend_init_s": backend_init_s,
        "compile_server_start_s": time.perf_counter() - start,
        "schemas": [],
    }
    for (what, _), p in zip(SCHEMAS, params, strict=True):
        times = []
        for _ in range(2):  # the second compile of the same spec hits the cache
            start = time.perf_counter()
            manager.grammar_init(p, prompt_token_ids=[]).init_matcher()  # no reasoning prompt
            times.append(time.perf_counter() - start)
        report["schemas"].append({"schema": what, "cold_s": times[0], "cached_s": times[1]})
    return report


@dataclass
class ABRun:
    elapsed: float
    output_lens: list[int]
    num_valid_json: int


def run_constrained_and_not(llm: Any, requests: list[SampleRequest]) -> tuple[ABRun, ABRun]:
    """After an untimed warm-up pass, the constrained run, then the same requests unconstrained with
    the constrained output lengths."""
    constrained = [
        SamplingParams(
            temperature=0.0,
            max_tokens=r.output_len,
            structured_outputs=StructuredOutputsParams(json=r.schema),
        )
        for r in requests
    ]
    # Untimed: the batch shapes met first pay their graph compilation (O2), whichever half meets them.
    _timed_run(
        llm,
        requests,
        [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests],
    )
    first = _timed_run(llm, requests, constrained)
    unconstrained = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in first.output_lens
    ]
    return first, _timed_run(llm, requests, unconstrained)


def _timed_run(llm: Any, requests: list[SampleRequest], params: list[SamplingParams]) -> ABRun:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    completions = [o.outputs[0] for o in outputs]
    return ABRun(elapsed, [len(c.token_ids) for c in completions], sum(_is_json(c.text) for c in completions))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
