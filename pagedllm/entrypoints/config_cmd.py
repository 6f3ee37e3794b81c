"""`pagedllm config show [engine options] [--json]`: the resolved configuration and its hash.

Every sub-config is shown after construction: its fields plus the public attributes construction
derived (the model's path, the resolved dtype, ...). Objects with no plain form (a transformers config)
are shown by their class name.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

_SCALARS = (bool, int, float, str, type(None))


def _is_config(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def to_plain(value: Any) -> Any:
    """A JSON-serializable form of a config value (enums by name, dtypes and paths as strings)."""
    import torch
    from transformers import PretrainedConfig

    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, PretrainedConfig):
        # Hundreds of HF attributes would drown the engine's own settings; the model's numbers that
        # matter are in model_config.model_arch_config.
        return f"<{type(value).__name__} model_type={value.model_type}>"
    if _is_config(value):
        return config_to_dict(value)
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [to_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    return f"<{type(value).__name__}>"


def config_to_dict(config: Any) -> dict[str, Any]:
    """Fields of a (sub-)config, then the public attributes its construction added."""
    result = {f.name: to_plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    for name, value in vars(config).items():
        if not name.startswith("_") and name not in result:
            result[name] = to_plain(value)
    return result


def describe(cfg: EngineConfig) -> dict[str, Any]:
    return {"hash": cfg.compute_hash(), "config": config_to_dict(cfg)}


def _flatten(prefix: str, value: Any, lines: list[str]) -> None:
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value) and prefix:
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, lines)
        return
    # Strings print bare unless they span lines (a chat template); everything else as JSON.
    text = value if isinstance(value, str) and "\n" not in value else json.dumps(value)
    lines.append(f"  {prefix} = {text}")


def format_text(description: dict[str, Any]) -> str:
    """One section per sub-config (`[cache_config]`), `name = value` lines, nested fields dotted."""
    config = description["config"]
    lines = [f"pagedllm engine configuration (hash {description['hash']})", "", "[engine]"]
    sections: list[tuple[str, dict[str, Any]]] = []
    for name, value in config.items():
        if isinstance(value, dict) and name.endswith("_config") and name != "additional_config":
            sections.append((name, value))
        else:
            _flatten(name, value, lines)
    for name, value in sections:
        lines += ["", f"[{name}]"]
        for key, item in value.items():
            _flatten(key, item, lines)
    return "\n".join(lines) + "\n"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagedllm.config.args import EngineArgs

    parser = subparsers.add_parser(
        "config",
        help="Show the resolved engine configuration.",
        description="Inspect the engine configuration.",
    )
    actions = parser.add_subparsers(dest="config_command", metavar="<action>", required=True)
    show = actions.add_parser(
        "show",
        help="Print every sub-config after construction, and the config hash.",
        description="Build the engine configuration from the options (the embedded SmolLM2-135M-Instruct "
        "model unless --model is given) and print it with its hash.",
    )
    show.add_argument("--json", action="store_true", dest="as_json", help="Print JSON instead of text.")
    EngineArgs.add_cli_args(show)
    return parser


def run(args: argparse.Namespace) -> int:
    from pagedllm.config.args import EngineArgs

    assert args.config_command == "show", args.config_command
    try:
        cfg = EngineArgs.from_cli_args(args).create_engine_config()
    except (ValueError, TypeError) as e:
        # Config errors name the offending option; a traceback would only bury that line.
        print(f"pagedllm config show: error: {e}", file=sys.stderr)
        return 2
    description = describe(cfg)
    if args.as_json:
        print(json.dumps(description, indent=2))
    else:
        print(format_text(description), end="")
    return 0
