"""`pagedllm generate` and `pagedllm chat` through the real console entry point (subprocesses), the
chat session's history handling in-process, and broken models reported as one line each."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_llm import hf_greedy, make_tiny_llm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from broken_models import make_broken_models  # noqa: E402

from pagedllm.config.args import EngineArgs  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.entrypoints import cli  # noqa: E402
from pagedllm.entrypoints.chat import ChatSession, chat_loop  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--optimization-level",
    "0",
    "--max-model-len",
    "128",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


def pagedllm(*args: str, stdin: str = "", timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_json_from_args_and_stdin(model_dir: Path) -> None:
    result = pagedllm(
        "generate", "Hello, world!", "-", "--model", str(model_dir), *ENGINE_FLAGS,
        "--json", "--temperature", "0", "--max-tokens", "6",
        stdin="The quick brown fox\n\nContinuous batching\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    prompts = ["Hello, world!", "The quick brown fox", "Continuous batching"]
    assert [r["prompt"] for r in records] == prompts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = hf_greedy(model_dir, [tokenizer.encode(p) for p in prompts], 6)
    assert [r["token_ids"] for r in records] == expected
    assert [r["text"] for r in records] == [tokenizer.decode(t, skip_special_tokens=True) for t in expected]


def test_generate_errors(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process through the same entry point (no interpreter start-up per case).
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["generate", "--model", str(model_dir), *ENGINE_FLAGS]) == 2
    assert "no prompt given" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--model", str(model_dir), "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--model", str(model_dir), *ENGINE_FLAGS, "--max-tokens", "500"]) == 1
    assert "max_tokens=500 is too large" in capsys.readouterr().err


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[Path, list[str]]]]:
    root = tmp_path_factory.mktemp("broken")
    return root / "good", make_broken_models(root)


def _generate_broken(good: Path, path: Path) -> list[str]:
    # GGUF files without tokenizer metadata take the tiny model's tokenizer. No flag that draws a
    # warning: the error line is all the output.
    return ["generate", "hi", "--model", str(path), "--max-model-len", "128", "--tokenizer", str(good)]


def test_broken_models_are_one_line_errors(
    broken: tuple[Path, dict[str, tuple[Path, list[str]]]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each broken model: exit status 1 and one error line naming the file (and the tensor at fault);
    before, most printed tracebacks, and a huge GGUF tensor count was a bare OverflowError."""
    good, cases = broken
    for name, (path, named) in cases.items():
        assert cli.main(_generate_broken(good, path)) == 1, name
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("pagedllm generate: error: "), (name, lines)
        assert all(words in lines[0] for words in named), (name, lines[0])


def test_broken_model_prints_no_traceback(broken: tuple[Path, dict[str, tuple[Path, list[str]]]]) -> None:
    good, cases = broken
    path, named = cases["st-truncated"]
    result = pagedllm(*_generate_broken(good, path))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(errors) == 1 and all(words in errors[0] for words in named), result.stderr


def test_chat_command(model_dir: Path) -> None:
    result = pagedllm(
        "chat", "--model", str(model_dir), *ENGINE_FLAGS, "--temperature", "0", "--max-tokens", "5",
        stdin="Hello\n/reset\nHi there\n/exit\nnever read\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") >= 2


def test_chat_session_keeps_history(model_dir: Path) -> None:
    args = EngineArgs(
        model=str(model_dir), dtype="float32", enforce_eager=True, optimization_level=0, max_model_len=128
    )
    engine = LLMEngine.from_engine_args(args)
    out = io.StringIO()
    params = SamplingParams(temperature=0.0, max_tokens=5)
    session = ChatSession(engine, params, system="Be brief.", out=out)
    first = session.send("Hello")
    assert out.getvalue() == first + "\n"
    assert session.history == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first},
    ]
    second = session.send("And then?")
    assert [m["role"] for m in session.history] == ["system", "user", "assistant", "user", "assistant"]
    assert session.history[-1]["content"] == second
    # The streamed reply equals the one-shot greedy reply to the same rendered conversation.
    tokenizer = engine.get_tokenizer()
    rendered = tokenizer.apply_chat_template(session.history[:-1], tokenize=False, add_generation_prompt=True)
    engine.add_request(
        "check", {"prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False)}, params
    )
    final = [o for o in _drain(engine) if o.finished][0]
    assert final.outputs[0].text == second
    session.reset()
    assert session.history == [{"role": "system", "content": "Be brief."}]


def test_chat_loop_reports_overflow_and_goes_on(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = EngineArgs(
        model=str(model_dir), dtype="float32", enforce_eager=True, optimization_level=0, max_model_len=64
    )
    engine = LLMEngine.from_engine_args(args)
    out = io.StringIO()
    session = ChatSession(engine, SamplingParams(temperature=0.0, max_tokens=4), out=out)
    chat_loop(session, io.StringIO("word " * 80 + "\nHi\n"), interactive=False)
    assert "error:" in capsys.readouterr().err
    # The long message was dropped; the next one was answered.
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["Hi"]


def _drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.slow
def test_generate_default_model_chat_template() -> None:
    result = pagedllm(
        "generate", "What is the capital of France?", "--apply-chat-template", "--temperature", "0",
        "--max-tokens", "6", "--max-model-len", "512", "--optimization-level", "0",
        "--kv-cache-memory-bytes", str(64 << 20),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
