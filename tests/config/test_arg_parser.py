"""FlexibleArgumentParser on a toy parser: dotted JSON shorthand, --config YAML, typo suggestions."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagedllm.config.arg_parser import (
    FlexibleArgumentParser,
    JSONMergeAction,
    deep_merge,
    parse_json_object,
    parse_json_value,
)


def toy_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="toy")
    parser.add_argument("--config")
    parser.add_argument("--size", type=int, default=1)
    parser.add_argument("--names", nargs="+", default=None)
    parser.add_argument("--flag", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--opts", "-o", action=JSONMergeAction, type=parse_json_object, default=None)
    parser.add_argument("target", nargs="?")
    return parser


def test_json_value_parsing() -> None:
    assert parse_json_value("3") == 3
    assert parse_json_value("[1,2]") == [1, 2]
    assert parse_json_value("true") is True
    assert parse_json_value("inductor") == "inductor"
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object"):
        parse_json_object("[1]")
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}, "d": 4}) == {"a": {"b": 3, "c": 2}, "d": 4}


def test_dotted_forms_merge_in_order() -> None:
    ns = toy_parser().parse_args(
        ["--opts", '{"a": 1, "n": {"x": 1}}', "-o.a=2", "--opts.n.y", "[1, 2]", "-o.n.x=s", "--opts.b-c=true"]
    )
    assert ns.opts == {"a": 2, "n": {"x": "s", "y": [1, 2]}, "b_c": True}


def test_dotted_needs_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["-o.a"])
    assert "expects a value" in capsys.readouterr().err


def test_dotted_on_non_json_flag_is_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["--size.a=1"])
    assert "unrecognized arguments: --size.a=1" in capsys.readouterr().err


def test_arguments_after_double_dash_are_left_alone() -> None:
    ns = toy_parser().parse_args(["--", "-o.a=1"])
    assert ns.target == "-o.a=1" and ns.opts is None


def test_config_file_values_are_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("size: 5\nnames: [a, b]\nflag: false\nquiet: true\nopts: {a: 1, n: {x: 1}}\n")
    ns = toy_parser().parse_args(["--config", str(path)])
    assert (ns.size, ns.names, ns.flag, ns.quiet, ns.opts) == (
        5,
        ["a", "b"],
        False,
        True,
        {"a": 1, "n": {"x": 1}},
    )
    ns = toy_parser().parse_args(["tgt", f"--config={path}", "--size", "7", "--flag", "-o.n.y=2"])
    assert (ns.target, ns.size, ns.flag) == ("tgt", 7, True)
    assert ns.opts == {"a": 1, "n": {"x": 1, "y": 2}}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("sise: 3\n", "did you mean --size"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("size: [1, 2]\n", "takes one value"),
        ("flag: 3\n", "must be true or false"),
        ("size: [unclosed\n", "not valid YAML"),
    ],
)
def test_config_file_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["--config", str(path)])
    assert message in capsys.readouterr().err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["--config", str(tmp_path / "none.yaml")])
    assert "cannot read --config file" in capsys.readouterr().err


def test_unknown_flag_in_subcommand_suggests_from_that_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    top = FlexibleArgumentParser(prog="top")
    sub = top.add_subparsers(dest="command")
    one = sub.add_parser("one")
    one.add_argument("--max-num-seqs")
    two = sub.add_parser("two")
    two.add_argument("--max-num-seeds")
    assert isinstance(one, FlexibleArgumentParser)
    with pytest.raises(SystemExit):
        top.parse_args(["one", "--max-num-seq", "3"])
    err = capsys.readouterr().err
    assert "did you mean --max-num-seqs?" in err
    assert "--max-num-seeds" not in err
    assert err.startswith("top one: error:")
