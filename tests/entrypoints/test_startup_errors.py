"""Start-up errors as the CLI prints them: one line, exit 1 for a broken model (also when a config
validator raised it and pydantic wrapped it), 2 for any other bad setting."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, field_validator

from pagedllm.entrypoints.startup_errors import report_startup_error
from pagedllm.errors import ModelLoadError


class _Config(BaseModel):
    model: str
    size: int = 1

    @field_validator("model")
    @classmethod
    def _readable(cls, value: str) -> str:
        if value == "broken":
            raise ModelLoadError("/m/model.safetensors: corrupt safetensors header\n  (header length 9)")
        if value == "bad":
            raise ValueError("model must not be 'bad'")
        return value


def _error(**fields: object) -> Exception:
    with pytest.raises(ValueError) as info:
        _Config(**fields)  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize(
    ("error", "status", "line"),
    [
        (ModelLoadError("/m.gguf: tensor 'x' runs past the end"), 1, "/m.gguf: tensor 'x' runs past the end"),
        (_error(model="broken"), 1, "/m/model.safetensors: corrupt safetensors header (header length 9)"),
        (_error(model="bad"), 2, "model must not be 'bad'"),
        (
            _error(model="ok", size="big"),
            2,
            "size: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
)
def test_one_line_and_status(
    error: Exception, status: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report_startup_error("serve", error) == status
    assert capsys.readouterr().err.splitlines() == [f"pagedllm serve: error: {line}"]
