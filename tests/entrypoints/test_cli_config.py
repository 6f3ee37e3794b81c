"""`pagedllm config show` (text and --json) and the `pagedllm` command registry."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from transformers import LlamaConfig

from pagedllm.config.args import EngineArgs
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.config_cmd import format_text


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=4096,
    ).save_pretrained(path)
    return str(path)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_config_show_default_model_text(smollm2_gguf: Path) -> None:
    result = run_cli("config", "show")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("pagedllm engine configuration (hash ")
    assert "[model_config]\n  model = SmolLM2-135M-Instruct\n" in out
    assert f"  gguf_file = {smollm2_gguf}\n" in out
    assert "  quantization = gguf\n" in out
    for section in (
        "[engine]",
        "[cache_config]",
        "[scheduler_config]",
        "[compilation_config]",
        "[kernel_config]",
    ):
        assert f"\n{section}\n" in out
    assert "  optimization_level = O2\n" in out
    # Nested sub-configs print dotted; the transformers config by name only.
    assert "  pass_config.fuse_norm_quant = " in out
    assert "  hf_config = <LlamaConfig model_type=llama>\n" in out


def test_config_show_json_matches_in_process_config(tiny_model: str) -> None:
    flags = ["--model", tiny_model, "--max-model-len", "1k", "-O0", "--block-size", "32", "-cc.mode=0"]
    flags += ["--dtype", "float32"]
    result = run_cli("config", "show", "--json", *flags)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    config = shown["config"]
    assert config["model_config"]["model"] == tiny_model
    assert config["model_config"]["max_model_len"] == 1000
    assert config["scheduler_config"]["max_model_len"] == 1000
    assert config["model_config"]["dtype"] == "torch.float32"
    assert config["cache_config"]["block_size"] == 32
    assert config["optimization_level"] == "O0"
    assert config["compilation_config"]["mode"] == "NONE"
    assert config["device_config"]["device"] == "cpu"
    assert config["speculative_config"] is None
    # No CUDA graphs on CPU: no capture sizes either.
    assert config["compilation_config"]["cudagraph_capture_sizes"] == []
    assert config["compilation_config"]["max_cudagraph_capture_size"] == 0
    # The hash is stable across processes: this process computes the same one from the same options.
    parser = cli.build_parser("config")[0]
    args = parser.parse_args(["config", "show", *flags])
    assert shown["hash"] == EngineArgs.from_cli_args(args).create_engine_config().compute_hash()
    assert len(shown["hash"]) == 10


def test_unknown_flag_fails_with_suggestion() -> None:
    result = run_cli("config", "show", "--max-num-seq", "4")
    assert result.returncode == 2
    assert "did you mean --max-num-seqs?" in result.stderr


def test_main_in_process(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "show", "--model", tiny_model, "--max-num-seqs", "3"]) == 0
    out = capsys.readouterr().out
    assert "\n[scheduler_config]\n" in out
    assert "  max_num_seqs = 3\n" in out
    # A value the config rejects: exit status 2 and the field's name, no traceback.
    assert cli.main(["config", "show", "--model", tiny_model, "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "block_size" in err and "Traceback" not in err
    # A feature pagedllm does not implement: refused by name, same exit status.
    assert cli.main(["config", "show", "--model", tiny_model, "--show-hidden-metrics-for-version", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "does not support: observability_config.show_hidden_metrics_for_version" in err
    assert "Traceback" not in err


def test_top_level_help_lists_commands_without_loading_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name, entry in cli.SUBCOMMANDS.items():
        assert name in out and entry.help in out
    parser, module = cli.build_parser(None)
    assert module is None


def test_console_script_help() -> None:
    script = shutil.which("pagedllm")
    if script is None:
        pytest.skip("the pagedllm console script is not installed (pip install -e .)")
    result = subprocess.run([script, "config", "show", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "CacheConfig:" in result.stdout and "--json" in result.stdout


def test_registry_rejects_a_module_without_the_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", cli.Subcommand("pagedllm.config.arg_parser", "x"))
    with pytest.raises(TypeError, match="has no add_parser"):
        cli.build_parser("broken")


def _command_module(events: list[str]) -> types.ModuleType:
    module = types.ModuleType("pagedllm_test_early_command")

    def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        events.append("parser built")
        parser = subparsers.add_parser("early")
        parser.add_argument("--n", type=int, required=True)
        return parser

    def start_early() -> str:
        events.append("started early")
        return "handle"

    def run(args: argparse.Namespace) -> int:
        events.append(f"run with {args.started_early} n={args.n}")
        return 0

    module.add_parser, module.start_early, module.run = add_parser, start_early, run  # type: ignore[attr-defined]
    return module


def test_start_early_runs_before_the_parser_and_reaches_run(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setitem(sys.modules, "pagedllm_test_early_command", _command_module(events))
    monkeypatch.setitem(cli.SUBCOMMANDS, "early", cli.Subcommand("pagedllm_test_early_command", "x"))
    assert cli.main(["early", "--n", "3"]) == 0
    assert events == ["started early", "parser built", "run with handle n=3"]

    # Asking for help starts nothing.
    events.clear()
    with pytest.raises(SystemExit):
        cli.main(["early", "--help"])
    assert events == ["parser built"]


def test_format_text_layout() -> None:
    text = format_text(
        {
            "hash": "0123456789",
            "config": {"optimization_level": "O2", "a_config": {"x": [1], "n": {"y": "z\nw"}}},
        }
    )
    assert text == (
        "pagedllm engine configuration (hash 0123456789)\n\n[engine]\n  optimization_level = O2\n\n"
        '[a_config]\n  x = [1]\n  n.y = "z\\nw"\n'
    )
