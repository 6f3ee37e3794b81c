"""EngineArgs: options -> EngineConfig, CLI flags (vLLM conventions), --config YAML, --help groups."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from pagedllm.config.arg_parser import FlexibleArgumentParser
from pagedllm.config.args import ARG_SPECS, FLAT_CONFIGS, INTERNAL_FIELDS, EngineArgs, human_readable_int
from pagedllm.config.compilation import CompilationMode, CUDAGraphMode
from pagedllm.config.engine import EngineConfig, OptimizationLevel
from pagedllm.config.model import ModelConfig
from pagedllm.platforms import override_platform


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama config.json: model configs read only the config, never weights."""
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


def make_parser(model_positional: bool = False) -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="pagedllm test")
    EngineArgs.add_cli_args(parser, model_positional=model_positional)
    return parser


def parse(argv: list[str], model_positional: bool = False) -> EngineArgs:
    return EngineArgs.from_cli_args(make_parser(model_positional).parse_args(argv))


def build(tiny_model: str, *argv: str) -> EngineConfig:
    return parse(["--model", tiny_model, *argv]).create_engine_config()


# -- the option set --------------------------------------------------------------------------------


def test_vllm_option_names_exist() -> None:
    names = """model tokenizer dtype max_model_len block_size enable_prefix_caching prefix_caching_hash_algo
    kv_cache_memory_bytes gpu_memory_utilization max_num_seqs max_num_batched_tokens enable_chunked_prefill
    scheduling_policy kv_cache_dtype tensor_parallel_size pipeline_parallel_size data_parallel_size
    distributed_executor_backend device load_format download_dir revision trust_remote_code seed
    enforce_eager max_logprobs served_model_name optimization_level performance_mode compilation_config
    speculative_config kernel_config structured_outputs_config shutdown_timeout""".split()
    missing = [n for n in names if n not in ARG_SPECS]
    assert not missing
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert fields == set(ARG_SPECS)


def test_every_flat_field_is_an_option_or_internal() -> None:
    top = EngineConfig.__pydantic_fields__
    fed = {target for spec in ARG_SPECS.values() for target in spec.targets}
    for config_field in FLAT_CONFIGS:
        cls = top[config_field].annotation
        cls = next(t for t in getattr(cls, "__args__", (cls,)) if hasattr(t, "__pydantic_fields__"))
        for field in cls.__pydantic_fields__:
            internal = field in INTERNAL_FIELDS.get(config_field, frozenset())
            assert internal != ((config_field, field) in fed), (config_field, field)


def test_defaults_match_the_sub_configs(tiny_model: str) -> None:
    via_args = EngineArgs(model=tiny_model).create_engine_config()
    direct = EngineConfig(model_config=ModelConfig(model=tiny_model))
    assert via_args.compute_hash() == direct.compute_hash()
    assert via_args.cache_config == direct.cache_config
    assert via_args.parallel_config == direct.parallel_config
    assert via_args.scheduler_config.max_num_seqs == direct.scheduler_config.max_num_seqs
    assert EngineArgs().model == "SmolLM2-135M-Instruct"
    assert EngineArgs().optimization_level == OptimizationLevel.O2


def test_unknown_kwarg_names_the_nearest_option() -> None:
    with pytest.raises(TypeError, match=r"'max_num_seq' \(did you mean 'max_num_seqs'"):
        EngineArgs(max_num_seq=4)
    with pytest.raises(TypeError, match="keyword arguments only"):
        EngineArgs("model")  # type: ignore[misc]


def test_kwargs_path_matches_cli_path(tiny_model: str) -> None:
    kwargs = EngineArgs(model=tiny_model, max_model_len=1024, block_size=32, max_num_seqs=8)
    cli = parse(
        ["--model", tiny_model, "--max-model-len", "1024", "--block-size", "32", "--max-num-seqs", "8"]
    )
    assert kwargs == cli
    assert kwargs.create_engine_config().compute_hash() == cli.create_engine_config().compute_hash()


# -- flags round trip to the EngineConfig -----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "check"),
    [
        (["--dtype", "bfloat16"], lambda c: c.model_config.dtype == torch.bfloat16),
        (["--dtype", "float16"], lambda c: c.model_config.dtype == torch.float16),
        (["--max-model-len", "2048"], lambda c: c.model_config.max_model_len == 2048),
        (["--max-model-len", "2k"], lambda c: c.model_config.max_model_len == 2000),
        (["--max-model-len", "2K"], lambda c: c.scheduler_config.max_model_len == 2048),
        (["--block-size", "32"], lambda c: c.cache_config.block_size == 32),
        (["--enable-prefix-caching"], lambda c: c.cache_config.enable_prefix_caching is True),
        (["--no-enable-prefix-caching"], lambda c: c.cache_config.enable_prefix_caching is False),
        (
            ["--prefix-caching-hash-algo", "xxhash"],
            lambda c: c.cache_config.prefix_caching_hash_algo == "xxhash",
        ),
        (["--kv-cache-memory-bytes", "64M"], lambda c: c.cache_config.kv_cache_memory_bytes == 64 * 2**20),
        (["--gpu-memory-utilization", "0.5"], lambda c: c.cache_config.gpu_memory_utilization == 0.5),
        (["--max-num-seqs", "7"], lambda c: c.scheduler_config.max_num_seqs == 7),
        (["--max-num-batched-tokens", "1K"], lambda c: c.scheduler_config.max_num_batched_tokens == 1024),
        (
            ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"],
            lambda c: c.scheduler_config.enable_chunked_prefill is False,
        ),
        (["--scheduling-policy", "priority"], lambda c: c.scheduler_config.policy == "priority"),
        (["--kv-cache-dtype", "bfloat16"], lambda c: c.cache_config.cache_dtype == "bfloat16"),
        (["--device", "cpu"], lambda c: c.device_config.device == torch.device("cpu")),
        (["--load-format", "dummy"], lambda c: c.load_config.load_format == "dummy"),
        (
            ["--download-dir", "/tmp/dl"],
            lambda c: c.load_config.download_dir == "/tmp/dl" and c.model_config.download_dir == "/tmp/dl",
        ),
        (["--revision", "main"], lambda c: c.model_config.revision == "main"),
        (["--trust-remote-code"], lambda c: c.model_config.trust_remote_code is True),
        (["--seed", "123"], lambda c: c.model_config.seed == 123),
        (
            ["--enforce-eager"],
            lambda c: c.model_config.enforce_eager and c.compilation_config.mode == CompilationMode.NONE,
        ),
        (["--max-logprobs", "5"], lambda c: c.model_config.max_logprobs == 5),
        (["--served-model-name", "a", "b"], lambda c: c.model_config.served_model_name == ["a", "b"]),
        (["--performance-mode", "interactivity"], lambda c: c.performance_mode == "interactivity"),
        (["--shutdown-timeout", "30"], lambda c: c.shutdown_timeout == 30),
        (
            ["--kernel-config", '{"enable_jit_warmup": false}'],
            lambda c: c.kernel_config.enable_jit_warmup is False,
        ),
        (
            ["--structured-outputs-config", '{"backend": "xgrammar", "disable_fallback": true}'],
            lambda c: (
                c.structured_outputs_config.backend == "xgrammar"
                and c.structured_outputs_config.disable_fallback
            ),
        ),
        (
            ["--structured-outputs-config.backend", "guidance"],
            lambda c: c.structured_outputs_config.backend == "guidance",
        ),
        (
            ["--structured-outputs-config.reasoning_parser", "qwen3"],
            lambda c: c.structured_outputs_config.reasoning_parser == "qwen3" and c.reasoning_config is None,
        ),
        (["--tensor-parallel-size", "2"], lambda c: c.parallel_config.tensor_parallel_size == 2),
        (
            ["-tp", "2"],
            lambda c: (
                c.parallel_config.tensor_parallel_size == 2
                and c.parallel_config.distributed_executor_backend == "mp"
            ),
        ),
        (
            ["--distributed-executor-backend", "mp"],
            lambda c: c.parallel_config.distributed_executor_backend == "mp",
        ),
    ],
)
def test_flag_round_trip(tiny_model: str, argv: list[str], check) -> None:
    assert check(build(tiny_model, *argv))


@pytest.mark.parametrize(
    ("argv", "check", "refused"),
    [
        (
            ["--data-parallel-size", "2", "--distributed-executor-backend", "ray"],
            lambda c: c.parallel_config.data_parallel_size == 2,
            "data parallelism with distributed_executor_backend='ray'",
        ),
        (
            ["--structured-outputs-config", '{"backend": "outlines"}'],
            lambda c: c.structured_outputs_config.backend == "outlines",
            "structured_outputs_config.backend",
        ),
        (
            ["--speculative-config.method", "eagle", "--speculative-config.num_speculative_tokens=2"],
            lambda c: c.speculative_config.method == "eagle" and c.num_lookahead_tokens == 2,
            "speculative_config.method='eagle'",
        ),
        (
            ["--show-hidden-metrics-for-version", "0.1"],
            lambda c: c.observability_config.show_hidden_metrics_for_version == "0.1",
            "show_hidden_metrics_for_version",
        ),
    ],
)
def test_unimplemented_flag_round_trip(tiny_model: str, argv: list[str], check, refused: str) -> None:
    """Flags of features pagedllm does not run still parse into the config (planning tools lift the
    gate), but a normal construction refuses them by name."""
    from pagedllm.config.support import allow_unsupported

    args = parse(["--model", tiny_model, *argv])
    with allow_unsupported():
        assert check(args.create_engine_config())
    with pytest.raises(ValueError, match=f"does not support: .*{re.escape(refused)}"):
        args.create_engine_config()


def test_model_flag_and_positional(tiny_model: str) -> None:
    assert build(tiny_model).model_config.model == tiny_model
    assert parse([tiny_model], model_positional=True).create_engine_config().model_config.model == tiny_model
    with pytest.raises(ValueError, match="given twice"):
        parse([tiny_model, "--model", "/other"], model_positional=True)


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        ([], OptimizationLevel.O2),
        (["-O0"], OptimizationLevel.O0),
        (["-O1"], OptimizationLevel.O1),
        (["-O3"], OptimizationLevel.O3),
        (["-O", "3"], OptimizationLevel.O3),
        (["--optimization-level", "1"], OptimizationLevel.O1),
        (["--optimization-level", "O0"], OptimizationLevel.O0),
        (["--optimization-level=2"], OptimizationLevel.O2),
    ],
)
def test_optimization_level_forms(tiny_model: str, argv: list[str], level: OptimizationLevel) -> None:
    cfg = build(tiny_model, *argv)
    assert cfg.optimization_level is level
    # O0 means no compilation; every higher level compiles (spec P33).
    expected = CompilationMode.NONE if level == OptimizationLevel.O0 else CompilationMode.VLLM_COMPILE
    assert cfg.compilation_config.mode == expected


def test_bad_optimization_level_is_rejected() -> None:
    with pytest.raises(SystemExit):
        make_parser().parse_args(["-O7"])


def test_compilation_config_json_and_dotted_shorthand_merge(tiny_model: str) -> None:
    args = parse(
        [
            "--compilation-config",
            '{"mode": 3, "cudagraph_capture_sizes": [8]}',
            "-cc.cudagraph_capture_sizes=[1,2]",
            "--compilation-config.pass_config.rope_kvcache_fusion_max_token_num",
            "128",
        ]
    )
    assert args.compilation_config == {
        "mode": 3,
        "cudagraph_capture_sizes": [1, 2],
        "pass_config": {"rope_kvcache_fusion_max_token_num": 128},
    }
    with override_platform("cuda", capability=(9, 0)):
        cfg = dataclasses.replace(args, model=tiny_model).create_engine_config()
    cc = cfg.compilation_config
    assert cc.mode == CompilationMode.VLLM_COMPILE
    assert cc.cudagraph_capture_sizes == [1, 2]
    assert cc.max_cudagraph_capture_size == 2
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert cc.pass_config.rope_kvcache_fusion_max_token_num == 128


def test_cc_mode_shorthand(tiny_model: str) -> None:
    cfg = build(tiny_model, "-cc.mode=0")
    assert cfg.compilation_config.mode == CompilationMode.NONE
    assert parse(["-cc.mode", "3"]).compilation_config == {"mode": 3}
    assert parse(["--compilation-config.mode=3"]).compilation_config == {"mode": 3}


def test_json_sub_config_errors_name_the_field(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="no_such_key"):
        build(tiny_model, "-cc.no_such_key=1")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--compilation-config", "{not json"])


def test_reasoning_parser_fills_both_sub_configs() -> None:
    # vLLM's flag fills both: the grammar waits for the reasoning end, the server splits the text. The
    # embedded model: the reasoning config looks its markers up in a real tokenizer.
    cfg = parse(
        ["--reasoning-parser", "deepseek_r1", "--structured-outputs-config.backend", "guidance"]
    ).create_engine_config()
    assert cfg.structured_outputs_config.reasoning_parser == "deepseek_r1"
    assert cfg.structured_outputs_config.backend == "guidance"
    assert cfg.reasoning_config is not None and cfg.reasoning_config.reasoning_parser == "deepseek_r1"
    # SmolLM2 has no <think> token: the config says reasoning token ids are off (P63).
    assert not cfg.reasoning_config.enabled


def test_reasoning_parser_errors(tiny_model: str) -> None:
    # An unknown name lists the known ones; a sub-config naming another parser is a conflict.
    with pytest.raises(
        ValueError, match="'nope' is not a reasoning parser; choose one of: deepseek_r1, qwen3"
    ):
        build(tiny_model, "--reasoning-parser", "nope")
    with pytest.raises(ValueError, match="reasoning_parser='qwen3' conflicts with reasoning_config"):
        build(tiny_model, "--reasoning-parser", "qwen3", "--reasoning-config.reasoning_parser", "deepseek_r1")


def test_speculative_config_reaches_the_engine_config(tiny_model: str) -> None:
    args = parse(
        ["--model", tiny_model, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    spec = args.create_engine_config().speculative_config
    # vLLM's defaults: prompt lookup of exactly 5 tokens when neither bound is given.
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram",
        3,
        5,
        5,
    )
    # A method without a drafter here is refused by name instead of ignored; so is a draft model
    # method without its model.
    with pytest.raises(ValueError, match="speculative_config.method='mtp'"):
        build(tiny_model, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}')
    with pytest.raises(ValueError, match="speculative_config.method='draft_model' without speculative_config.model"):
        build(tiny_model, "--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3}')


def test_unsupported_parallelism_is_named(tiny_model: str) -> None:
    assert build(tiny_model, "-pp", "2").parallel_config.pipeline_parallel_size == 2
    assert build(tiny_model, "-dp", "2").parallel_config.data_parallel_size == 2
    # vLLM's --data-parallel-rank / -dpr: the one rank of a server behind an external load balancer.
    rank = build(tiny_model, "-dp", "2", "-dpr", "1", "--data-parallel-external-lb").parallel_config
    assert (rank.data_parallel_index, rank.data_parallel_external_lb) == (1, True)
    with pytest.raises(ValueError, match="--data-parallel-external-lb"):
        build(tiny_model, "-dp", "2", "--data-parallel-rank", "1")


def test_field_validation_errors_name_the_field(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="block_size"):
        build(tiny_model, "--block-size", "0")
    with pytest.raises(ValueError, match="shutdown_timeout"):
        build(tiny_model, "--shutdown-timeout", "-1")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--dtype", "float8"])


# -- --config file.yaml ----------------------------------------------------------------------------


def test_yaml_config_file_and_cli_override(tiny_model: str, tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(
        f"model: {tiny_model}\n"
        "max_num_seqs: 8\n"
        "max-model-len: 1K\n"
        "enable_prefix_caching: false\n"
        "served_model_name: [x, y]\n"
        "compilation_config:\n  cudagraph_capture_sizes: [4]\n  mode: 3\n"
        "optimization_level: 1\n"
    )
    args = parse(["--config", str(path), "--max-num-seqs", "4", "-cc.cudagraph_capture_sizes=[2]"])
    assert args.max_num_seqs == 4  # the command line wins
    assert args.max_model_len == 1024
    assert args.enable_prefix_caching is False
    assert args.served_model_name == ["x", "y"]
    assert args.compilation_config == {"cudagraph_capture_sizes": [2], "mode": 3}
    cfg = args.create_engine_config()
    assert cfg.scheduler_config.max_num_seqs == 4
    assert cfg.optimization_level is OptimizationLevel.O1
    assert cfg.cache_config.enable_prefix_caching is False


def test_yaml_unknown_key_suggests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("max_num_seq: 8\n")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--config", str(path)])
    assert "did you mean --max-num-seqs" in capsys.readouterr().err


# -- --help and unknown flags ------------------------------------------------------------------------


def test_help_is_grouped_by_config_class() -> None:
    parser = make_parser()
    titles = {group.title: group for group in parser._action_groups}
    for name in (
        "ModelConfig",
        "CacheConfig",
        "SchedulerConfig",
        "ParallelConfig",
        "CompilationConfig",
        "EngineConfig",
    ):
        assert name in titles
    in_group = {name: {a.dest for a in titles[name]._group_actions} for name in titles}
    assert "block_size" in in_group["CacheConfig"]
    assert "scheduling_policy" in in_group["SchedulerConfig"]
    assert "compilation_config" in in_group["CompilationConfig"]
    text = parser.format_help()
    # Field docstrings, choices and defaults are in the help.
    assert "Size of a KV cache block in tokens" in text
    assert "{fcfs,priority}" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE" in text
    assert "-O {O0,O1,O2,O3}" in text
    # A JSON option's group lists its keys with their docs.
    assert "cudagraph_capture_sizes - Batch sizes (tokens) to capture CUDA graphs for" in text
    assert "-cc.KEY=VALUE" in text


def test_unknown_flag_suggests_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        make_parser().parse_args(["--max-num-seq", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-num-seq" in err
    assert "did you mean --max-num-seqs" in err


def test_abbreviations_are_not_accepted() -> None:
    # argparse would otherwise take --block-s as --block-size and hide typos.
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--block-s", "8"])


def test_from_cli_args_ignores_foreign_attributes() -> None:
    ns = make_parser().parse_args(["--max-num-seqs", "3"])
    ns.port = 8000  # a command's own flag
    assert EngineArgs.from_cli_args(ns).max_num_seqs == 3
    assert isinstance(ns, argparse.Namespace)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("32768", 32768),
        ("4k", 4000),
        ("4K", 4096),
        ("1.5k", 1500),
        ("2m", 2_000_000),
        ("2M", 2 * 2**20),
        ("1G", 2**30),
    ],
)
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["", "k", "1.5K", "4x", "-3", "1.0001k"])
def test_human_readable_int_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)
