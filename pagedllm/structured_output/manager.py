"""The engine core's side of structured outputs: compile grammars off the step loop, keep one matcher
per request, and fill the step's token bitmask in one batched call per backend.

Grammars compile in the worker processes of a compile server (`compile_client.py`), each driven from
a thread of a small pool, so the step loop never waits on one: the scheduler keeps a request in WAITING_FOR_FSM until its grammar is
ready, and a grammar that does not compile within `compile_timeout_s` is stopped and fails its
requests. Compiled grammars are cached by (backend, kind, spec, options) in a cache bounded in bytes
(`PAGEDLLM_XGRAMMAR_CACHE_MB`): many requests with the same schema compile it once. The tokenizer and
the backends' vocabulary tables are built on the pool too, when the first constrained request arrives,
so an engine that never sees one pays nothing.

With a reasoning parser (`structured_outputs_config.reasoning_parser`), the grammar constrains only
the answer: while a request is still reasoning its bitmask row allows every token and its matcher does
not move; the matcher starts with the first token after the reasoning's end token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pagedllm.reasoning import ReasoningParser, get_reasoning_parser
from pagedllm.structured_output.backends import BACKEND_CLASSES, Matcher, apply_switches
from pagedllm.structured_output.cache import GrammarCache
from pagedllm.structured_output.compile_client import CompileClient, CompileTimeoutError, CompileWorkerError
from pagedllm.structured_output.limits import check_limits
from pagedllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("pagedllm.structured_output")

# A compiled grammar, with the backend that compiled it.
Compiled = tuple[str, Any]


class StructuredOutputRequest:
    """One request's grammar: compiling (a future), then a matcher that follows the request's tokens."""

    def __init__(
        self, manager: StructuredOutputManager, compiled: Future[Compiled], prompt_token_ids: list[int]
    ) -> None:
        self.manager = manager
        # Known once compiled: a constraint the front-end did not resolve is resolved by the compiler.
        self.backend = ""
        self._compiled = compiled
        self._prompt_token_ids = prompt_token_ids
        self.matcher: Matcher | None = None
        # Whether the grammar applies yet (set by init_matcher; always True without a reasoning parser).
        self.reasoning_ended = False

    def is_ready(self) -> bool:
        return self._compiled.done()

    def init_matcher(self) -> None:
        """Once ready: build the matcher. Raises the compile error of a grammar that failed."""
        self.backend, compiled = self._compiled.result()
        self.matcher = self.manager.backend(self.backend).new_matcher(compiled)
        reasoner = self.manager.reasoner
        # A prompt can close the reasoning itself (Qwen3's template with enable_thinking=false).
        self.reasoning_ended = reasoner is None or reasoner.is_reasoning_end(self._prompt_token_ids)

    def accept_token(self, token_id: int) -> bool:
        assert self.matcher is not None
        if not self.reasoning_ended:
            assert self.manager.reasoner is not None
            # Only the end marker starts the grammar. A reasoning parser may also end the reasoning at a
            # tool call (qwen3); the grammar constrains the answer, and starting it inside the call
            # would force the call's arguments into the answer's shape, so the call is left free.
            self.reasoning_ended = token_id == self.manager.reasoner.end_token_id
            return True
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(
        self,
        structured_outputs_config: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        load_tokenizer: Any,
        max_workers: int = 2,
    ) -> None:
        """``load_tokenizer`` is a callable returning the HF tokenizer (called once, on the pool)."""
        self.config = structured_outputs_config
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        # Built with the tokenizer (on the pool, before any grammar is ready); None: no reasoning phase.
        self.reasoner: ReasoningParser | None = None
        self._backends: dict[str, Any] = {}
        # Held while the tokenizer and a backend's vocabulary tables are built (seconds, on the pool);
        # the cache's lock is another, so that the step loop never waits on that.
        self._backends_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache = GrammarCache(structured_outputs_config.grammar_cache_bytes())
        # Each pool thread drives one compile worker process at a time.
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagedllm-grammar")
        self.compile_client = CompileClient(max_workers, structured_outputs_config.compile_memory_mb())
        # Called (from a pool thread) whenever a compilation finishes: the engine's loop sleeps while
        # every request waits for a grammar, and wakes up on this.
        self._ready_listeners: list[Callable[[], None]] = []

    def backend(self, name: str) -> Any:
        built = self._backends.get(name)
        if built is not None:  # the step loop's case: no lock to wait on
            return built
        with self._backends_lock:
            if name not in self._backends:
                if self._tokenizer is None:
                    self._tokenizer = self._load_tokenizer()
                    self.reasoner = self._make_reasoner(self._tokenizer)
                self._backends[name] = BACKEND_CLASSES[name](
                    self._tokenizer, self.vocab_size, self.stop_token_ids
                )
            return self._backends[name]

    def _make_reasoner(self, tokenizer: Any) -> ReasoningParser | None:
        name = self.config.reasoning_parser
        if not name:
            return None
        reasoner = get_reasoning_parser(name)(tokenizer.get_vocab(), decode=tokenizer.decode)
        if not reasoner.has_end_token:
            logger.warning(
                "reasoning parser %s: %r is not one token of this vocabulary, so the end of the "
                "reasoning cannot be seen; structured outputs constrain the whole output",
                name,
                reasoner.end_token,
            )
            return None
        return reasoner

    def add_ready_listener(self, listener: Callable[[], None]) -> None:
        self._ready_listeners.append(listener)

    def grammar_init(
        self, params: StructuredOutputsParams, prompt_token_ids: list[int]
    ) -> StructuredOutputRequest:
        """Start compiling ``params``' grammar (or reuse the cached one); never blocks. ValueError for a
        constraint over the configured limits."""
        if params.resolved_backend is None:
            # The front-end's job; done here for clients that talk to the core directly (the compile
            # worker picks the backend).
            apply_switches(params, self.config)
        key = (
            params.resolved_backend,
            params.kind,
            params.spec(),
            params.disable_any_whitespace,
            params.disable_additional_properties,
            params.whitespace_pattern,
        )
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                # The front-end checked this already; the core checks what it compiles itself.
                check_limits(params, self.config)
                future = self._pool.submit(self._compile, params)
                self._cache.add(key, future)
                start = True
            else:
                start = False
        if start:
            future.add_done_callback(lambda done: self._on_compiled(key, done))
        return StructuredOutputRequest(self, future, prompt_token_ids)

    def _compile(self, params: StructuredOutputsParams) -> Compiled:
        backend, payload = self.compile_client.compile(
            params, self.config, self._worker_init, self.config.compile_timeout_s
        )
        return backend, self.backend(backend).load(payload)

    def _worker_init(self, name: str) -> str | None:
        return self.backend(name).worker_init()  # type: ignore[no-any-return]

    def _on_compiled(self, key: tuple[Any, ...], future: Future[Compiled]) -> None:
        error = None if future.cancelled() else future.exception()
        with self._lock:
            if isinstance(error, CompileTimeoutError | CompileWorkerError) or future.cancelled():
                # Not the constraint's fault for certain (a loaded machine, a killed worker): a later
                # request compiles it again.
                self._cache.discard(key, future)
            else:
                size = len(key[2]) + (len(str(error)) if error is not None else self._size(future.result()))
                self._cache.finished(key, future, size)
        for listener in self._ready_listeners:
            listener()

    def _size(self, compiled: Compiled) -> int:
        backend, grammar = compiled
        return int(BACKEND_CLASSES[backend].memory_size(grammar))

    def cache_stats(self) -> tuple[int, int]:
        """(entries, bytes) of the compiled-grammar cache."""
        with self._lock:
            return len(self._cache), self._cache.total_bytes

    def grammar_bitmask(self, grammars: list[StructuredOutputRequest]) -> np.ndarray:
        """int32 [len(grammars), ceil(vocab / 32)], row i the tokens grammars[i] allows next; one
        batched fill per backend."""
        bitmask = np.full((len(grammars), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        by_backend: dict[str, tuple[list[Matcher], list[int]]] = {}
        for row, grammar in enumerate(grammars):
            if grammar.matcher is None or grammar.is_terminated() or not grammar.reasoning_ended:
                # A finished grammar leaves its row open (the request stops on this token); so does
                # one whose request is still reasoning.
                continue
            matchers, rows = by_backend.setdefault(grammar.backend, ([], []))
            matchers.append(grammar.matcher)
            rows.append(row)
        for name, (matchers, rows) in by_backend.items():
            self.backend(name).fill_bitmask(matchers, bitmask, rows)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.compile_client.close()
