"""`EngineArgs`: one flat set of user-facing options, turned into an `EngineConfig`.

`LLM(**kwargs)` and every CLI command go through it. The options are not restated here: they are read
from the sub-config classes (pydantic dataclasses whose attribute docstrings are field descriptions).
- Fields of the "flat" sub-configs (`FLAT_CONFIGS`) are top-level options: `block_size`, `max_num_seqs`,
  flags `--block-size`, `--max-num-seqs`. A name shared by two flat sub-configs (`download_dir`) is one
  option feeding both.
- Every other sub-config of `EngineConfig` is one JSON option named after its field:
  `compilation_config={"mode": 3}`, `--compilation-config '{"mode": 3}'` or `-cc.mode=3`.
- `EngineConfig`'s own scalar fields (`optimization_level`, `performance_mode`, `shutdown_timeout`)
  are options too.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import functools
import re
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic.fields import FieldInfo

from pagedllm.config.arg_parser import (
    CONFIG_FILE_FLAG,
    JSONMergeAction,
    parse_json_object,
    parse_json_value,
)
from pagedllm.config.engine import EngineConfig

# Sub-configs whose fields are flattened into EngineArgs, in --help order.
FLAT_CONFIGS = (
    "model_config",
    "cache_config",
    "scheduler_config",
    "parallel_config",
    "device_config",
    "load_config",
    "offload_config",
    "observability_config",
    "logging_config",
)
# Sub-config fields the engine derives or writes; users never set them.
INTERNAL_FIELDS: dict[str, frozenset[str]] = {
    "cache_config": frozenset({"num_gpu_blocks", "num_cpu_blocks", "use_kda_recoverssm"}),
    "parallel_config": frozenset({"rank", "is_moe_model"}),
    # The scheduler's context length is the model's resolved one; its runner follows the model.
    "scheduler_config": frozenset({"max_model_len", "max_num_scheduled_tokens", "runner_type"}),
}
# EngineConfig fields that are not options: the flat sub-configs, and what construction derives.
TOP_LEVEL_INTERNAL = frozenset({"instance_id", "quant_config", *FLAT_CONFIGS})
# vLLM's names where they differ from the sub-config field.
RENAMES: dict[tuple[str, str], str] = {
    ("scheduler_config", "policy"): "scheduling_policy",
    ("cache_config", "cache_dtype"): "kv_cache_dtype",
    ("parallel_config", "data_parallel_index"): "data_parallel_rank",
}
SHORT_FLAGS: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",),
    "data_parallel_rank": ("-dpr",),
    "optimization_level": ("-O",),
    "compilation_config": ("-cc",),
}
# vLLM's options that set one field in several JSON sub-configs (building a sub-config not given).
SHORTCUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "reasoning_parser": (
        ("structured_outputs_config", "reasoning_parser"),
        ("reasoning_config", "reasoning_parser"),
    ),
}
# vLLM's flags that turn an optional sub-config on (built with its defaults unless given as JSON), and
# its flat options for that sub-config's fields (which need the flag).
ENABLE_FLAGS: dict[str, tuple[str, str]] = {
    "enable_lora": ("lora_config", "Serve LoRA adapters (the lora_config options below, or --lora-config)."),
}
SHORTCUTS.update(
    {
        name: (("lora_config", name),)
        for name in (
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
            "lora_dtype",
            "fully_sharded_loras",
            "lora_allowed_roots",
        )
    }
)
# Sizes that accept `4k` (4000) / `4K` (4096) style suffixes on the command line.
HUMAN_READABLE_INTS = frozenset({"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"})
# Resolved values one sub-config takes from another already-built one.
DERIVED_FIELDS: dict[tuple[str, str], Callable[[dict[str, Any]], Any]] = {
    ("scheduler_config", "max_model_len"): lambda built: built["model_config"].max_model_len,
}

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(text: str) -> int:
    """`"4k"` -> 4000, `"4K"` -> 4096, `"1.5m"` -> 1500000, `"32768"` -> 32768 (vLLM's convention:
    lowercase suffixes are decimal, uppercase binary; decimals only with decimal suffixes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; expected an integer like 2048, 4k or 8K")
    number, suffix = match.groups()
    if "." in number and suffix not in ("k", "m", "g"):
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: a fraction needs a decimal suffix k, m or g (not K/M/G, which are binary)"
        )
    value = float(number) * _SUFFIXES[suffix] if suffix else int(number)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: not a whole number")
    return int(value)


def _enum_parser(enum_cls: type[enum.Enum]) -> Callable[[str], enum.Enum]:
    """Accept a member's name (any case, `O3` for OptimizationLevel.O3) or its value."""

    def parse(text: str) -> enum.Enum:
        by_name = {m.name.lower(): m for m in enum_cls}
        if text.lower() in by_name:
            return by_name[text.lower()]
        for member in enum_cls:
            if str(member.value) == text:
                return member
        choices = ", ".join(f"{m.name}/{m.value}" for m in enum_cls)
        raise argparse.ArgumentTypeError(f"invalid {enum_cls.__name__} {text!r}; expected one of {choices}")

    parse.__name__ = enum_cls.__name__
    return parse


def _strip_annotated(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _members(tp: Any) -> list[Any]:
    """The non-None alternatives of a (possibly Optional/Annotated) annotation."""
    tp = _strip_annotated(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [_strip_annotated(t) for t in typing.get_args(tp) if t is not type(None)]
    return [tp]


def _is_config_class(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "__pydantic_fields__")


def _sub_config_class(annotation: Any) -> type | None:
    classes = [t for t in _members(annotation) if _is_config_class(t)]
    return classes[0] if classes else None


def _scalar_kwargs(tp: Any) -> dict[str, Any]:
    """argparse `type`/`choices` for one value of type `tp`."""
    if typing.get_origin(tp) is Literal:
        values = list(typing.get_args(tp))
        return {"type": type(values[0]), "choices": values}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {
            "type": _enum_parser(tp),
            "choices": list(tp),
            "metavar": "{" + ",".join(m.name for m in tp) + "}",
        }
    if tp in (int, float, str):
        return {"type": tp}
    return {"type": parse_json_value}


def _argparse_kwargs(name: str, annotation: Any) -> dict[str, Any]:
    """argparse keyword arguments for an option annotated `annotation`."""
    members = _members(annotation)
    # `str | list[str]`-style unions take the list form; `Literal[...] | torch.dtype` the literal one.
    lists = [t for t in members if typing.get_origin(t) is list]
    literals = [t for t in members if typing.get_origin(t) is Literal]
    if lists:
        (item,) = typing.get_args(lists[0]) or (str,)
        return {"nargs": "+", **_scalar_kwargs(_strip_annotated(item))}
    if members == [bool]:
        return {"action": argparse.BooleanOptionalAction}
    if literals:
        return _scalar_kwargs(literals[0])
    if any(t is dict or typing.get_origin(t) is dict for t in members):
        return {"action": JSONMergeAction, "type": parse_json_object, "metavar": "JSON"}
    if len(members) == 1:
        kwargs = _scalar_kwargs(members[0])
        if members[0] is int and name in HUMAN_READABLE_INTS:
            kwargs["type"] = human_readable_int
        return kwargs
    return {"type": parse_json_value}


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One EngineArgs option and where its value goes."""

    name: str
    """EngineArgs attribute; the flag is `--` + name with dashes."""
    kind: Literal["flat", "json", "top", "shortcut", "enable"]
    """flat: a field of flat sub-configs; json: a whole sub-config; top: an EngineConfig field;
    shortcut: one field of JSON sub-configs (`SHORTCUTS`); enable: builds a sub-config (`ENABLE_FLAGS`)."""
    targets: tuple[tuple[str, str], ...]
    """(EngineConfig field, sub-config field) pairs fed by this option; for json/top the field is ""."""
    group_cls: type
    """The config class the option belongs to; its --help group is named after it."""
    annotation: Any
    info: FieldInfo
    config_cls: type | None = None
    """The sub-config class of a json option."""

    @property
    def group(self) -> str:
        return self.group_cls.__name__

    @property
    def flags(self) -> tuple[str, ...]:
        return ("--" + self.name.replace("_", "-"), *SHORT_FLAGS.get(self.name, ()))

    def default(self) -> Any:
        if self.kind == "json":
            return None
        if self.info.default_factory is not None:
            return self.info.default_factory()  # type: ignore[call-arg]
        return self.info.default

    def dataclass_field(self) -> Any:
        if self.kind == "json" or self.info.default_factory is None:
            return dataclasses.field(default=self.default())
        return dataclasses.field(default_factory=self.info.default_factory)  # type: ignore[arg-type]

    def help(self) -> str:
        if self.kind == "json":
            flags = " or ".join(f"{f}.KEY=VALUE" for f in self.flags)
            text = f"JSON object with the keys listed above; one key at a time: {flags}."
        else:
            text = f"{_one_line(self.info.description)} Default: {_show_default(self.default())}."
        return text.replace("%", "%%")


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _show_default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    if _is_config_class(type(value)):
        return f"{type(value).__name__}()"
    return repr(value)


def _choices_text(annotation: Any) -> str:
    for tp in _members(annotation):
        if typing.get_origin(tp) is Literal:
            return "{" + ",".join(str(v) for v in typing.get_args(tp)) + "} "
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return "{" + ",".join(m.name for m in tp) + "} "
    return ""


def _group_description(cls: type, spec: ArgSpec | None) -> str:
    """The class doc; for a JSON option also every key with its choices, doc and default."""
    lines = [_one_line(cls.__doc__)]
    if spec is not None:
        for key, info in cls.__pydantic_fields__.items():  # type: ignore[attr-defined]
            if info.init is False:
                continue
            default = _show_default(
                info.default_factory() if info.default_factory is not None else info.default
            )
            text = (
                f"{key} {_choices_text(info.annotation)}- {_one_line(info.description)} Default: {default}."
            )
            lines.append(textwrap.fill(text, width=100, initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines).replace("%", "%%")


def _top_level_fields() -> dict[str, FieldInfo]:
    return dict(EngineConfig.__pydantic_fields__)  # type: ignore[attr-defined]


def _build_specs() -> dict[str, ArgSpec]:
    top = _top_level_fields()
    specs: dict[str, ArgSpec] = {}
    for config_field in FLAT_CONFIGS:
        cls = _sub_config_class(top[config_field].annotation)
        assert cls is not None, f"EngineConfig.{config_field} is not a sub-config"
        internal = INTERNAL_FIELDS.get(config_field, frozenset())
        for field, info in cls.__pydantic_fields__.items():  # type: ignore[attr-defined]
            if field in internal or info.init is False:
                continue
            name = RENAMES.get((config_field, field), field)
            previous = specs.get(name)
            if previous is None:
                specs[name] = ArgSpec(name, "flat", ((config_field, field),), cls, info.annotation, info)
                continue
            # One option feeds every flat sub-config that has the field; that only works when they agree.
            if previous.default() != ArgSpec(name, "flat", (), cls, info.annotation, info).default():
                raise TypeError(
                    f"option {name!r} is in {previous.group} and {cls.__name__} with different defaults; "
                    "rename one in pagedllm.config.args.RENAMES or mark it internal"
                )
            specs[name] = dataclasses.replace(previous, targets=(*previous.targets, (config_field, field)))
    for config_field, info in top.items():
        if config_field in TOP_LEVEL_INTERNAL:
            continue
        cls = _sub_config_class(info.annotation)
        if config_field in specs:
            raise TypeError(f"EngineConfig.{config_field} collides with a flattened sub-config field")
        if cls is not None:
            specs[config_field] = ArgSpec(
                config_field, "json", ((config_field, ""),), cls, info.annotation, info, cls
            )
        else:
            specs[config_field] = ArgSpec(
                config_field, "top", ((config_field, ""),), EngineConfig, info.annotation, info
            )
    for name, (config_field, doc) in ENABLE_FLAGS.items():
        cls = _sub_config_class(top[config_field].annotation)
        assert cls is not None and name not in specs
        specs[name] = ArgSpec(
            name, "enable", ((config_field, ""),), cls, bool, FieldInfo(default=False, description=doc)
        )
    for name, targets in SHORTCUTS.items():
        config_field, field = targets[0]
        cls = _sub_config_class(top[config_field].annotation)
        assert cls is not None and name not in specs
        info = cls.__pydantic_fields__[field]  # type: ignore[attr-defined]
        specs[name] = ArgSpec(name, "shortcut", targets, cls, info.annotation, info)
    return specs


ARG_SPECS: dict[str, ArgSpec] = _build_specs()


def unknown_option_message(unknown: list[str], owner: str = "EngineArgs") -> str:
    parts = []
    for name in unknown:
        matches = difflib.get_close_matches(name, list(ARG_SPECS), n=3, cutoff=0.75)
        hint = f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""
        parts.append(f"{name!r}{hint}")
    return f"{owner} got unknown option(s): {', '.join(parts)}"


def _with_spec_fields(cls: type) -> type:
    """Make `cls` a keyword-only dataclass with one field per ArgSpec; unknown kwargs get suggestions."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for spec in ARG_SPECS.values():
        annotations[spec.name] = (
            dict[str, Any] | spec.config_cls | None if spec.kind == "json" else spec.annotation
        )
        setattr(cls, spec.name, spec.dataclass_field())
    cls.__annotations__ = annotations
    cls = dataclasses.dataclass(kw_only=True)(cls)
    generated_init = cls.__init__

    @functools.wraps(generated_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"{cls.__name__} takes keyword arguments only")
        unknown = [k for k in kwargs if k not in ARG_SPECS]
        if unknown:
            raise TypeError(unknown_option_message(unknown, cls.__name__))
        generated_init(self, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_with_spec_fields
class EngineArgs:
    """Every user-facing engine option (see `ARG_SPECS` for the list and where each one goes)."""

    def create_engine_config(self) -> EngineConfig:
        """Build every sub-config from these options, then the EngineConfig that checks them together."""
        top = _top_level_fields()
        sub_kwargs: dict[str, dict[str, Any]] = {name: {} for name in FLAT_CONFIGS}
        kwargs: dict[str, Any] = {}
        for spec in ARG_SPECS.values():
            value = getattr(self, spec.name)
            if spec.kind == "flat":
                for config_field, field in spec.targets:
                    sub_kwargs[config_field][field] = value
            elif spec.kind == "json":
                if value is not None:
                    kwargs[spec.name] = self._sub_config(spec, value)
            elif spec.kind in ("shortcut", "enable"):
                continue  # below, once the JSON sub-configs are built
            else:
                kwargs[spec.name] = value
        built: dict[str, Any] = {}
        for config_field in FLAT_CONFIGS:
            for (target, field), derive in DERIVED_FIELDS.items():
                if target == config_field:
                    sub_kwargs[config_field][field] = derive(built)
            cls = _sub_config_class(top[config_field].annotation)
            assert cls is not None
            built[config_field] = cls(**sub_kwargs[config_field])
        for spec in ARG_SPECS.values():
            config_field = spec.targets[0][0]
            if spec.kind == "enable" and getattr(self, spec.name) and kwargs.get(config_field) is None:
                # Built with its flat options at once: a sub-config may derive defaults from them.
                values = {
                    s.targets[0][1]: getattr(self, s.name)
                    for s in ARG_SPECS.values()
                    if s.kind == "shortcut"
                    and s.targets[0][0] == config_field
                    and getattr(self, s.name) != s.default()
                }
                kwargs[config_field] = spec.group_cls(**values)
        enabled = {spec.targets[0][0]: spec.name for spec in ARG_SPECS.values() if spec.kind == "enable"}
        for spec in ARG_SPECS.values():
            if spec.kind == "shortcut" and getattr(self, spec.name) != spec.default():
                config_field = spec.targets[0][0]
                if config_field in enabled and kwargs.get(config_field) is None:
                    flag = enabled[config_field]
                    raise ValueError(f"{spec.name} needs {flag}=True (--{flag.replace('_', '-')})")
                self._apply_shortcut(spec, getattr(self, spec.name), kwargs)
        return EngineConfig(**built, **kwargs)

    @staticmethod
    def _apply_shortcut(spec: ArgSpec, value: Any, kwargs: dict[str, Any]) -> None:
        """Set `value` in each target sub-config (built with defaults when not given); a sub-config
        given with another value there is a conflict."""
        top = _top_level_fields()
        for config_field, field in spec.targets:
            cls = _sub_config_class(top[config_field].annotation)
            assert cls is not None
            sub = kwargs.get(config_field)
            if sub is None:
                kwargs[config_field] = cls(**{field: value})
                continue
            current = getattr(sub, field)
            if current not in (value, spec.default()):
                raise ValueError(f"{spec.name}={value!r} conflicts with {config_field}.{field}={current!r}")
            kwargs[config_field] = dataclasses.replace(sub, **{field: value})

    @staticmethod
    def _sub_config(spec: ArgSpec, value: Any) -> Any:
        assert spec.config_cls is not None
        if isinstance(value, spec.config_cls):
            return value
        if isinstance(value, dict):
            return spec.config_cls(**value)
        raise TypeError(
            f"{spec.name} must be a dict or a {spec.config_cls.__name__}, got {type(value).__name__}"
        )

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, *, model_positional: bool = False
    ) -> argparse.ArgumentParser:
        """Add every option as a flag, in one argument group per config class.

        `model_positional` also accepts the model as the first positional argument (`serve MODEL`)."""
        if model_positional:
            parser.add_argument(
                "model_tag", nargs="?", default=None, metavar="MODEL", help="The model (same as --model)."
            )
        parser.add_argument(
            CONFIG_FILE_FLAG,
            metavar="FILE.yaml",
            default=None,
            help="YAML file whose keys are option names (e.g. max_num_seqs: 8); flags given on the command "
            "line override it.",
        )
        groups: dict[str, argparse._ArgumentGroup] = {}
        for spec in ARG_SPECS.values():
            group = groups.get(spec.group)
            if group is None:
                description = _group_description(spec.group_cls, spec if spec.kind == "json" else None)
                group = groups[spec.group] = parser.add_argument_group(spec.group, description)
            if spec.kind == "json":
                kwargs: dict[str, Any] = {
                    "action": JSONMergeAction,
                    "type": parse_json_object,
                    "metavar": "JSON",
                }
            else:
                kwargs = _argparse_kwargs(spec.name, spec.annotation)
            group.add_argument(
                *spec.flags, dest=spec.name, default=spec.default(), help=spec.help(), **kwargs
            )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed by a parser that `add_cli_args` set up."""
        kwargs = {name: getattr(args, name) for name in ARG_SPECS if hasattr(args, name)}
        model_tag = getattr(args, "model_tag", None)
        if model_tag is not None:
            given = kwargs.get("model", ARG_SPECS["model"].default())
            if given not in (model_tag, ARG_SPECS["model"].default()):
                raise ValueError(f"the model is given twice: positional {model_tag!r} and --model {given!r}")
            kwargs["model"] = model_tag
        return cls(**kwargs)
