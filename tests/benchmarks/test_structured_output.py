"""The json workload of `bench throughput`: realistic schemas, each a valid JSON Schema, cycled over the
requests, each prompt asking for its own request's schema."""

from __future__ import annotations

import json

import jsonschema
from tiny_llm import build_tokenizer

from pagedllm.benchmarks.structured_output import SCHEMAS, json_requests


def test_schemas_are_valid_and_cycled_with_their_prompts() -> None:
    for _, schema in SCHEMAS:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    tokenizer = build_tokenizer()
    requests = json_requests(len(SCHEMAS) + 2, 7, tokenizer)
    assert [r.schema for r in requests] == [s for _, s in SCHEMAS] + [SCHEMAS[0][1], SCHEMAS[1][1]]
    for request in requests:
        assert request.output_len == 7 and request.prompt_token_ids
        assert json.dumps(request.schema) in tokenizer.decode(request.prompt_token_ids)
