"""LoRA adapters served under their own model names (vLLM's `--lora-modules` and runtime loading).

- `--enable-lora --lora-modules name=path ...` (or the JSON form
  `'{"name": ..., "path": ..., "base_model_name": ...}'`): adapters loaded and checked at start-up.
- A request's `model` picks the adapter by name; `/v1/models` lists each adapter with `parent` (the
  base model's served name, or the JSON form's `base_model_name`) and `root` (its path).
- With `PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1`: `POST /v1/load_lora_adapter`
  `{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter` `{"lora_name"}`. A bad adapter
  (missing path, shapes of another base model, rank above max_lora_rank) is a 400; an unknown name a
  404; unloading an adapter that unfinished requests use is a 400 (they are never disturbed).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path` or a JSON object with `name`, `path` and optionally `base_model_name`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: invalid JSON {text!r}: {e}") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown or not spec.get("name") or not spec.get("path"):
            raise ValueError(
                "--lora-modules JSON needs 'name' and 'path' (and optionally 'base_model_name'), "
                f"got {text!r}"
            )
        return LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules entries are name=path or JSON, got {text!r}")
    return LoRAModulePath(name, path)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class LoRARegistry:
    """The adapters this server serves, by name."""

    def __init__(self, engine: AsyncLLM, base_model_names: list[str]) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    async def load(self, module: LoRAModulePath) -> LoRARequest:
        if module.name in self.adapters:
            raise OpenAIError(f"The lora adapter '{module.name}' has already been loaded.", param="lora_name")
        if module.name in self.base_model_names:
            raise OpenAIError(f"'{module.name}' is the base model's name", param="lora_name")
        request = LoRARequest(module.name, next(self._ids), module.path, module.base_model_name)
        try:
            await self.engine.add_lora(request)
        except ValueError as e:
            raise OpenAIError(str(e), param="lora_path") from e
        self.adapters[module.name] = request
        return request

    async def unload(self, name: str) -> None:
        request = self.adapters.get(name)
        if request is None:
            raise OpenAIError(
                f"The lora adapter '{name}' cannot be found.", HTTPStatus.NOT_FOUND, param="lora_name"
            )
        try:
            await self.engine.remove_lora(request.lora_int_id)
        except ValueError as e:
            raise OpenAIError(str(e), param="lora_name") from e
        del self.adapters[name]


def add_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await registry.load(LoRAModulePath(request.lora_name, request.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await registry.unload(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
