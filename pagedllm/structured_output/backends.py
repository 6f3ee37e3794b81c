"""The grammar engines: xgrammar and llguidance behind one small interface.

A backend's `compile_payload` turns a request's `StructuredOutputsParams` into a compiled grammar as
text (it runs in a compile worker process, `compile_server.py`, which can be stopped); in the engine
`load` turns that text into the compiled grammar (cached by the manager), `new_matcher` makes a matcher
per request from it, and `fill_bitmask` fills the bitmask rows of many matchers in one call. `validate`
checks a constraint without a tokenizer, so the front-end can refuse a bad schema, regex or grammar
before the request is queued.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from pagedllm.errors import RequestError
from pagedllm.structured_output.limits import check_limits
from pagedllm.structured_output.params import StructuredOutputsParams

BACKENDS = ("xgrammar", "guidance")


class Matcher(Protocol):
    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...


def _schema(params: StructuredOutputsParams) -> dict[str, Any] | bool:
    return json.loads(params.json) if isinstance(params.json, str) else params.json  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------- xgrammar
def _xgrammar_grammar(params: StructuredOutputsParams) -> Any:
    import xgrammar as xgr

    kind = params.kind
    if params.whitespace_pattern is not None:
        raise RequestError(
            "structured_outputs",
            "structured_outputs.whitespace_pattern is not supported by the xgrammar backend",
        )
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(
                json.dumps(_schema(params)), any_whitespace=not params.disable_any_whitespace
            )
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            # JSON string literals are valid EBNF string literals (same escapes).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except (RuntimeError, ValueError, TypeError) as e:
        _raise_if_out_of_memory(e)
        raise RequestError(
            "structured_outputs", f"structured_outputs.{kind} is invalid: {_first_line(e)}"
        ) from e


def _raise_if_out_of_memory(error: Exception) -> None:
    """xgrammar reports an allocation it could not make (a compile worker's memory bound) as a
    RuntimeError naming std::bad_alloc: a MemoryError, not a bad constraint."""
    if "bad_alloc" in str(error):
        raise MemoryError(str(error)) from error


class _XgrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._info_json: str | None = None
        self._batch = xgr.BatchGrammarMatcher()

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        _xgrammar_grammar(params)

    def worker_init(self) -> str:
        """What a compile worker needs to compile for this vocabulary: the tokenizer info, serialized."""
        if self._info_json is None:
            self._info_json = self.info.serialize_json()
        return self._info_json

    @staticmethod
    def make_compiler(worker_init: str) -> Any:
        """In a compile worker: the compiler for the vocabulary `worker_init` describes. Its cache is
        off: the engine keeps the compiled grammars, in a bounded cache."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(worker_init)
        # One thread: the engine compiles grammars side by side, each in its own worker.
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @staticmethod
    def compile_payload(params: StructuredOutputsParams, compiler: Any) -> str:
        grammar = _xgrammar_grammar(params)
        try:
            return str(compiler.compile_grammar(grammar).serialize_json())
        except RuntimeError as e:
            _raise_if_out_of_memory(e)
            raise

    def load(self, payload: str) -> Any:
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(payload, self.info)

    @staticmethod
    def memory_size(compiled: Any) -> int:
        return int(compiled.memory_size_bytes)

    def new_matcher(self, compiled: Any) -> _XgrammarMatcher:
        import xgrammar as xgr

        return _XgrammarMatcher(xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, matchers: list[Any], bitmask: np.ndarray, rows: list[int]) -> None:
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask, rows)


# ---------------------------------------------------------------------------------------- guidance
def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _guidance_grammar(params: StructuredOutputsParams) -> str:
    import llguidance

    kind = params.kind
    if kind == "json" or kind == "json_object":
        schema: Any = _schema(params) if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)  # type: ignore[arg-type]
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
    elif kind == "choice":
        grammar = llguidance.grammar_from("choice", json.dumps(params.choice))
    elif kind == "grammar":
        grammar = llguidance.grammar_from("grammar", params.grammar)  # type: ignore[arg-type]
    else:
        raise RequestError(
            "structured_outputs", "structured_outputs.structural_tag is not supported by the guidance backend"
        )
    return grammar


def _guidance_checked_grammar(params: StructuredOutputsParams) -> str:
    import llguidance

    kind = params.kind
    try:
        grammar = _guidance_grammar(params)
    except ValueError as e:
        if str(e).startswith("structured_outputs."):
            raise
        # llguidance refuses some inputs already while converting them (e.g. a GBNF with an undefined rule).
        raise RequestError(
            "structured_outputs", f"structured_outputs.{kind} is invalid: {_first_line(e)}"
        ) from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise RequestError(
            "structured_outputs", f"structured_outputs.{kind} is invalid: {_first_line(error)}"
        )
    return grammar


class _GuidanceMatcher:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        _guidance_checked_grammar(params)

    def worker_init(self) -> None:
        return None

    @staticmethod
    def make_compiler(worker_init: str | None) -> None:
        return None

    @staticmethod
    def compile_payload(params: StructuredOutputsParams, compiler: Any) -> str:
        return _guidance_checked_grammar(params)

    @staticmethod
    def load(payload: str) -> str:
        return payload

    @staticmethod
    def memory_size(compiled: str) -> int:
        return len(compiled)

    def new_matcher(self, compiled: str) -> _GuidanceMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise RequestError(
                "structured_outputs", f"the grammar could not be compiled: {_first_line(matcher.get_error())}"
            )
        return _GuidanceMatcher(matcher)

    def fill_bitmask(self, matchers: list[Any], bitmask: np.ndarray, rows: list[int]) -> None:
        for matcher, row in zip(matchers, rows, strict=True):
            target = bitmask[row]
            matcher.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)


def _first_line(error: object) -> str:
    # xgrammar prefixes its messages with a timestamp and a source location.
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def resolve_backend(params: StructuredOutputsParams, configured: str, disable_fallback: bool) -> str:
    """Validate ``params`` and return the backend that takes it. ``auto`` prefers xgrammar and falls
    back to guidance for what xgrammar cannot take (unless ``disable_fallback``)."""
    if configured not in ("auto", *BACKENDS):
        raise ValueError(
            f"structured_outputs_config.backend={configured!r} is not supported; use 'auto', 'xgrammar' or 'guidance'"
        )
    if configured == "guidance":
        GuidanceBackend.validate(params)
        return "guidance"
    try:
        XgrammarBackend.validate(params)
        return "xgrammar"
    except ValueError:
        if configured == "xgrammar" or disable_fallback:
            raise
        try:
            GuidanceBackend.validate(params)
        except ValueError:
            pass
        else:
            return "guidance"
        raise


BACKEND_CLASSES: dict[str, Any] = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}


def apply_switches(params: StructuredOutputsParams, config: Any) -> None:
    """Apply a StructuredOutputsConfig's whitespace and additional-properties switches to a constraint."""
    params.disable_any_whitespace |= config.disable_any_whitespace
    params.disable_additional_properties |= config.disable_additional_properties


def apply_engine_config(params: StructuredOutputsParams, config: Any) -> None:
    """Apply a StructuredOutputsConfig to a request's constraint: check its limits, apply its switches,
    and pick the backend (validating the constraint on the way: the grammar engine's conversion, which
    can take a while: the server runs it in a child process that it kills at a deadline,
    `ConstraintChecker`)."""
    check_limits(params, config)
    apply_switches(params, config)
    params.resolved_backend = resolve_backend(params, config.backend, config.disable_fallback)
