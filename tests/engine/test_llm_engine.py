"""LLMEngine over a scripted core client (front-end logic), and over the real EngineCore on a tiny model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from scripted_model import SCRIPT, fake_engine_config

from pagedllm.config import LoggingConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.errors import ErrorReport
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import get_tokenizer


class ScriptedCore:
    """Emits the tokens of SCRIPT one per step for every request, finishing at max_tokens."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.requests: dict[str, EngineCoreRequest] = {}
        self.progress: dict[str, int] = {}
        self.aborted: list[str] = []
        self.reject: dict[str, ErrorReport] = {}
        self.pending_errors: dict[str, ErrorReport] = {}
        self.prefix_cache_resets = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.reject:
            self.pending_errors[request.request_id] = self.reject[request.request_id]
            return
        self.requests[request.request_id] = request
        self.progress[request.request_id] = 0

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def get_output(self) -> EngineCoreOutputs:
        outputs = []
        for request_id, request in list(self.requests.items()):
            done = self.progress[request_id]
            token = self.script[done % len(self.script)]
            self.progress[request_id] = done + 1
            finished = done + 1 >= request.sampling_params.max_tokens
            outputs.append(
                EngineCoreOutput(request_id, [token], finish_reason=FinishReason.LENGTH if finished else None)
            )
            if finished:
                del self.requests[request_id]
        errors, self.pending_errors = self.pending_errors, {}
        return EngineCoreOutputs(outputs, errors=errors)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.pending_errors)

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    def shutdown(self) -> None:
        self.requests.clear()


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    return get_tokenizer(smollm2_gguf)


@pytest.fixture
def engine(tokenizer: Any) -> LLMEngine:
    config = fake_engine_config()
    return LLMEngine(config, engine_core=ScriptedCore(tokenizer.encode(SCRIPT)), tokenizer=tokenizer)  # type: ignore[arg-type]


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_requests_run_to_completion(engine: LLMEngine, tokenizer: Any) -> None:
    engine.add_request("a", "Count:", SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("b", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=5))
    assert engine.get_num_unfinished_requests() == 2
    finished = run(engine)
    script = tokenizer.encode(SCRIPT)
    assert finished["a"].outputs[0].token_ids == script[:3]
    assert finished["a"].outputs[0].text == tokenizer.decode(script[:3])
    assert finished["b"].outputs[0].token_ids == script[:5]
    assert finished["b"].prompt is None and finished["b"].prompt_token_ids == [5, 6]
    assert not engine.has_unfinished_requests()


def test_stop_string_aborts_core_request(engine: LLMEngine) -> None:
    engine.add_request("a", "Count:", SamplingParams(max_tokens=10, stop=" four"))
    finished = run(engine)
    assert finished["a"].outputs[0].text == " one two three"
    assert finished["a"].outputs[0].stop_reason == " four"
    assert engine.engine_core.aborted == ["a"]  # type: ignore[attr-defined]


def test_n_children_in_core(engine: LLMEngine) -> None:
    engine.add_request("p", "Count:", SamplingParams(n=3, seed=7, max_tokens=2, temperature=0.7))
    core = engine.engine_core
    assert sorted(core.requests) == ["0_p", "1_p", "2_p"]  # type: ignore[attr-defined]
    assert [core.requests[f"{i}_p"].sampling_params.seed for i in range(3)] == [7, 8, 9]  # type: ignore[attr-defined]
    finished = run(engine)
    assert [c.index for c in finished["p"].outputs] == [0, 1, 2]


def test_abort_request(engine: LLMEngine) -> None:
    engine.add_request("p", "Count:", SamplingParams(n=2, max_tokens=8))
    engine.add_request("s", "Count:", SamplingParams(max_tokens=8))
    engine.step()
    engine.abort_request(["p", "s"])
    assert sorted(engine.engine_core.aborted) == ["0_p", "1_p", "s"]  # type: ignore[attr-defined]
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_validation_and_duplicate_ids(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="max_tokens=500 is too large"):
        engine.add_request("a", "Count:", SamplingParams(max_tokens=500))
    assert not engine.has_unfinished_requests()
    engine.add_request("a", "Count:", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "Count:", SamplingParams(max_tokens=2))


def test_core_rejection_raises(engine: LLMEngine) -> None:
    engine.engine_core.reject["a"] = ErrorReport("ValueError: no room")  # type: ignore[attr-defined]
    engine.add_request("a", "Count:", SamplingParams(max_tokens=2))
    engine.add_request("b", "Count:", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="request 'a': ValueError: no room"):
        engine.step()
    # The other request's output of that step is not lost: the next call returns it.
    assert engine.has_unfinished_requests()
    (output,) = engine.step()
    assert output.request_id == "b" and output.finished
    assert not engine.has_unfinished_requests()


def test_lost_request_is_an_error_not_a_hang(engine: LLMEngine) -> None:
    engine.add_request("a", "Count:", SamplingParams(max_tokens=4))
    engine.engine_core.requests.clear()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="no record of requests"):
        engine.step()


def test_tokenizer_and_prefix_cache(engine: LLMEngine, tokenizer: Any) -> None:
    assert engine.get_tokenizer() is tokenizer
    assert engine.reset_prefix_cache() is True
    assert engine.engine_core.prefix_cache_resets == 1  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    from tiny_llm import make_tiny_llm

    from pagedllm.config.args import EngineArgs

    model_dir = make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))
    args = EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, optimization_level=0
    )
    return LLMEngine.from_engine_args(args)


def test_real_core_streams_each_output_kind(real_engine: LLMEngine) -> None:
    params = {
        kind: SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind)
        for kind in RequestOutputKind
    }
    for kind, p in params.items():
        real_engine.add_request(kind.name, "The quick brown fox", p)
    seen: dict[str, list[RequestOutput]] = {kind.name: [] for kind in RequestOutputKind}
    while real_engine.has_unfinished_requests():
        for output in real_engine.step():
            seen[output.request_id].append(output)
    final = seen["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished
    tokens, text = final[0].outputs[0].token_ids, final[0].outputs[0].text
    assert len(tokens) == 6
    cumulative = seen["CUMULATIVE"]
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 7))
    assert cumulative[-1].outputs[0].token_ids == tokens and cumulative[-1].outputs[0].text == text
    delta = seen["DELTA"]
    assert [t for o in delta for t in o.outputs[0].token_ids] == tokens
    assert "".join(o.outputs[0].text for o in delta) == text


def test_real_core_abort_frees_the_request(real_engine: LLMEngine) -> None:
    real_engine.add_request("long", "Hello", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    real_engine.step()
    real_engine.step()
    real_engine.abort_request("long")
    assert not real_engine.has_unfinished_requests()
    # The core drops it too: its next step has nothing to run.
    real_engine.step()
    assert not real_engine.engine_core.has_unfinished_requests()


def test_request_log_truncated_to_max_log_len(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """--enable-log-requests offline: each request when it arrives, each sequence when it ends, texts and
    token lists cut to max_log_len."""
    config = fake_engine_config(logging_config=LoggingConfig(enable_log_requests=True, max_log_len=4))
    engine = LLMEngine(config, engine_core=ScriptedCore(tokenizer.encode(SCRIPT)), tokenizer=tokenizer)  # type: ignore[arg-type]
    prompt = "Count to ten:"
    prompt_ids = tokenizer.encode(prompt)
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.request_logger"):
        engine.add_request("a", prompt, SamplingParams(max_tokens=6))
        engine.add_request("p", prompt, SamplingParams(n=2, max_tokens=2, temperature=0.5))
        run(engine)
    lines = [r.getMessage() for r in caplog.records]
    received = [line for line in lines if line.startswith("Received request")]
    generated = sorted(line for line in lines if line.startswith("Generated response"))
    assert len(received) == 2 and len(generated) == 3  # one line per sequence of the n=2 request
    assert received[0].startswith("Received request a: prompt: 'Coun', params: SamplingParams(")
    assert received[0].endswith(f"prompt_token_ids: {prompt_ids[:4]}.")
    output_ids = tokenizer.encode(SCRIPT)[:6]
    output_text = tokenizer.decode(output_ids)
    assert generated[-1] == (
        f"Generated response a: output: {output_text[:4]!r}, output_token_ids: {output_ids[:4]}, "
        "finish_reason: length"
    )
    assert [line.split(":")[0] for line in generated[:2]] == ["Generated response 0_p", "Generated response 1_p"]
