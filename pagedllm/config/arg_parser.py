"""`FlexibleArgumentParser`: argparse with vLLM's command-line conventions.

On top of argparse it understands
- dotted shorthand for JSON-valued options: `-cc.mode=3`, `--compilation-config.mode 3`,
  `-cc.pass_config.fuse_norm_quant=true`; every fragment and every whole `--compilation-config '{json}'`
  is deep-merged into one dict, later ones winning;
- `--config file.yaml`: the file's keys are flag names (dashes or underscores) and act as defaults, so
  flags on the command line override the file;
- unknown flags fail with the nearest valid names.
Subparsers created from it are of the same class, so every subcommand gets these rules.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

CONFIG_FILE_FLAG = "--config"


def parse_json_value(text: str) -> Any:
    """A JSON literal (`3`, `true`, `[1,2]`, `{"a":1}`), or the text itself when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `update`, recursing into nested dicts (neither input is modified)."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_json_object(text: str) -> dict[str, Any]:
    """argparse `type=` for JSON-object options; the error names the problem for argparse to show."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


class JSONMergeAction(argparse.Action):
    """Stores a JSON object; repeated occurrences (and dotted fragments) are deep-merged in order."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        # An EngineArgs default may be a config object rather than a dict; the flag then replaces it.
        base = current if isinstance(current, dict) else {}
        setattr(namespace, self.dest, deep_merge(base, values))


def _dotted_to_dict(path: str, value: Any) -> dict[str, Any]:
    """`"pass_config.fuse_norm_quant", True` -> `{"pass_config": {"fuse_norm_quant": True}}`."""
    keys = [k.replace("-", "_") for k in path.split(".")]
    if any(not k for k in keys):
        raise ValueError(f"empty key in dotted option path {path!r}")
    result: dict[str, Any] = {keys[-1]: value}
    for key in reversed(keys[:-1]):
        result = {key: result}
    return result


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An `ArgumentParser` with dotted JSON shorthand, `--config file.yaml` and typo suggestions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Abbreviations would silently accept typos such as `--max-num-seq`; vLLM turns them off too.
        kwargs.setdefault("allow_abbrev", False)
        # Group descriptions list a JSON option's keys one per line; keep that layout.
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self._subparsers_action: argparse._SubParsersAction | None = None

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        action = super().add_subparsers(**kwargs)
        self._subparsers_action = action
        return action

    # -- argv preprocessing ------------------------------------------------------------------------

    def _json_option_strings(self) -> set[str]:
        return {s for a in self._actions if isinstance(a, JSONMergeAction) for s in a.option_strings}

    def _expand_dotted(self, args: list[str]) -> list[str]:
        """Rewrite `-cc.key=value` / `--flag.key value` into `--flag '{"key": value}'`."""
        json_flags = self._json_option_strings()
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg == "--":
                out.extend(args[i - 1 :])
                break
            base, dot, rest = arg.partition(".")
            if not (arg.startswith("-") and dot and base in json_flags):
                out.append(arg)
                continue
            path, eq, text = rest.partition("=")
            if not eq:
                if i >= len(args):
                    self.error(f"{arg} expects a value")
                text = args[i]
                i += 1
            try:
                fragment = _dotted_to_dict(path, parse_json_value(text))
            except ValueError as e:
                self.error(f"{arg}: {e}")
            out.extend([base, json.dumps(fragment)])
        return out

    def _split_config_file(self, args: list[str]) -> tuple[list[str], Path | None]:
        if CONFIG_FILE_FLAG not in self._option_string_actions:
            return args, None
        rest: list[str] = []
        path: Path | None = None
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == CONFIG_FILE_FLAG:
                if i + 1 >= len(args):
                    self.error(f"{CONFIG_FILE_FLAG} expects a YAML file path")
                path = Path(args[i + 1])
                i += 2
                continue
            if arg.startswith(CONFIG_FILE_FLAG + "="):
                path = Path(arg.split("=", 1)[1])
            else:
                rest.append(arg)
            i += 1
        return rest, path

    def _config_file_args(self, path: Path) -> list[str]:
        """Turn a YAML mapping of flag names to values into command-line arguments."""
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            self.error(f"cannot read {CONFIG_FILE_FLAG} file {str(path)!r}: {e}")
        except yaml.YAMLError as e:
            self.error(f"{CONFIG_FILE_FLAG} file {str(path)!r} is not valid YAML: {e}")
        if data is None:
            return []
        if not isinstance(data, dict):
            self.error(f"{CONFIG_FILE_FLAG} file {str(path)!r} must hold a mapping of option names to values")
        argv: list[str] = []
        for key, value in data.items():
            flag = "--" + str(key).replace("_", "-")
            action = self._option_string_actions.get(flag)
            if action is None or flag == CONFIG_FILE_FLAG:
                self.error(
                    f"unknown option {key!r} in {CONFIG_FILE_FLAG} file {str(path)!r}{self._hint(flag)}"
                )
            argv.extend(self._yaml_value_args(flag, action, value))
        return argv

    def _yaml_value_args(self, flag: str, action: argparse.Action, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                self.error(f"{flag} in the config file must be true or false, got {value!r}")
            return [flag if value else "--no-" + flag[2:]]
        if isinstance(action, argparse._StoreTrueAction):
            return [flag] if value else []
        if isinstance(action, JSONMergeAction):
            return [flag, json.dumps(value)]
        if isinstance(value, list):
            if action.nargs not in ("+", "*"):
                self.error(f"{flag} takes one value, the config file gives a list: {value!r}")
            return [flag, *(str(v) for v in value)]
        if isinstance(value, dict):
            return [flag, json.dumps(value)]
        return [flag, str(value)]

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        argv = self._expand_dotted(argv)
        argv, config_path = self._split_config_file(argv)
        if config_path is not None:
            # The file's values are parsed first into the namespace; argparse then fills defaults only
            # for what is still missing, so the command line's flags override the file's.
            file_args = self._expand_dotted(self._config_file_args(config_path))
            namespace, extra = super().parse_known_args(file_args, namespace)
            if extra:
                self.error(
                    f"invalid values in {CONFIG_FILE_FLAG} file {str(config_path)!r}: {' '.join(extra)}"
                )
        return super().parse_known_args(argv, namespace)

    # -- unknown flags -----------------------------------------------------------------------------

    def _leaf_parser(self, namespace: argparse.Namespace) -> FlexibleArgumentParser:
        """The (sub)parser that parsed the last subcommand, for suggestions from its own flags."""
        parser: FlexibleArgumentParser = self
        while parser._subparsers_action is not None:
            dest = parser._subparsers_action.dest
            chosen = getattr(namespace, dest, None) if dest != argparse.SUPPRESS else None
            child = parser._subparsers_action.choices.get(chosen) if chosen else None
            if not isinstance(child, FlexibleArgumentParser):
                break
            parser = child
        return parser

    def _suggestions(self, flag: str) -> list[str]:
        candidates = [s for s in self._option_string_actions if s.startswith("--")]
        return difflib.get_close_matches(flag, candidates, n=3, cutoff=0.75)

    def _hint(self, flag: str) -> str:
        matches = self._suggestions(flag)
        return f" (did you mean {', '.join(matches)}?)" if matches else ""

    def error(self, message: str) -> NoReturn:
        # The full usage of an engine command is a hundred lines; the message and a pointer suffice.
        self.exit(2, f"{self.prog}: error: {message}\n(run `{self.prog} --help` for the options)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            leaf = self._leaf_parser(parsed)
            lines = [f"unrecognized arguments: {' '.join(extras)}"]
            for extra in extras:
                if extra.startswith("-"):
                    flag = extra.split("=", 1)[0]
                    matches = leaf._suggestions(flag)
                    if matches:
                        lines.append(f"  {flag}: did you mean {', '.join(matches)}?")
            leaf.error("\n".join(lines))
        return parsed
