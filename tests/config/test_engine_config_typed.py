"""Code that takes the engine configuration says so in its signature: `engine_config: EngineConfig`,
never `Any`."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

PACKAGE = Path(pagedllm.__file__).parent


def _untyped(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        args = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            args = [ast.arg(arg=node.target.id, annotation=node.annotation, lineno=node.lineno)]
        for arg in args:
            if arg.arg == "engine_config" and arg.annotation is not None:
                if ast.unparse(arg.annotation) in ("Any", "Any | None", "object"):
                    found.append(f"{path.relative_to(PACKAGE)}:{arg.lineno}")
    return found


def test_engine_config_is_typed() -> None:
    files = [p for p in PACKAGE.rglob("*.py") if "seed" not in p.parts]
    untyped = [hit for p in files for hit in _untyped(p)]
    assert untyped == []
