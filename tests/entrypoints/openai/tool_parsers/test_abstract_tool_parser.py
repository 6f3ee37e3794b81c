"""The registry: a --tool-parser-plugin file registers its own parser, which then reads outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

PLUGIN = '''
from pagedllm.entrypoints.openai.tool_parsers import ParsedText, ToolCallPrefix, ToolParser, ToolParserManager


@ToolParserManager.register_module("call_line")
class CallLineParser(ToolParser):
    """CALL name {json} on a line of its own."""

    def parse(self, text, final):
        if not text.startswith("CALL "):
            return ParsedText(text)
        name, _, arguments = text[5:].partition(" ")
        return ParsedText("", [ToolCallPrefix(name, arguments)])
'''


def test_plugin_file_registers_a_parser(tmp_path: Path) -> None:
    path = tmp_path / "my_parser.py"
    path.write_text(PLUGIN)
    ToolParserManager.import_tool_parser(str(path))
    try:
        info = ToolParserManager.get_tool_parser("call_line")().extract_tool_calls('CALL lookup {"q": "x"}')
        assert info.tools_called and info.content is None
        assert (info.tool_calls[0].function.name, info.tool_calls[0].function.arguments) == (
            "lookup",
            '{"q": "x"}',
        )
    finally:
        ToolParserManager.tool_parsers.pop("call_line", None)


def test_bad_plugins_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tool-parser-plugin .* is not a file"):
        ToolParserManager.import_tool_parser(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="--tool-parser-plugin .* failed to load: boom"):
        ToolParserManager.import_tool_parser(str(broken))


def test_only_tool_parsers_register() -> None:
    with pytest.raises(TypeError, match="must subclass ToolParser"):
        ToolParserManager.register_module("x")(int)  # type: ignore[type-var]
