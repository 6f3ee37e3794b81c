"""Which operation routes the server registers (no server, no engine): none by default, the profiler
routes only with a profiler configured, the rest only with PAGEDLLM_SERVER_DEV_MODE=1; and how their
errors answer (400 for bad arguments, 503 while the engine sleeps), in OpenAI's error shape."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedllm.engine.utility import EngineSleepingError
from pagedllm.entrypoints.openai.dev_routes import register_operation_routes
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response

ROUTES = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/collective_rpc"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/update_weights"),
    ("POST", "/update_weights_from_disk"),
]
PROFILE_ROUTES = [("POST", "/start_profile"), ("POST", "/stop_profile")]


class RecordingEngine:
    """Records the operations the routes ask for (what the real AsyncLLM would run in the core)."""

    def __init__(self, profiler: str | None) -> None:
        self.engine_config = SimpleNamespace(profiler_config=SimpleNamespace(profiler=profiler))
        self.calls: list[tuple[Any, ...]] = []

    async def call_utility(self, method: str, *args: Any) -> Any:
        self.calls.append((method, *args))
        if method == "collective_rpc" and args[0] == "fail":
            raise ValueError("bad method")
        return ["trace.json"] if method == "stop_profile" else 3

    async def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self, tags: list[str] | None) -> None:
        self.calls.append(("wake_up", tags))

    def is_sleeping(self) -> bool:
        return False


def _client(monkeypatch: pytest.MonkeyPatch, dev_mode: str, profiler: str | None) -> tuple[TestClient, Any]:
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", dev_mode)
    app, engine = FastAPI(), RecordingEngine(profiler)

    # As build_app does: OpenAIError answers in OpenAI's shape.
    app.add_exception_handler(OpenAIError, lambda _, exc: error_response(exc))  # type: ignore[arg-type]

    @app.post("/v1/completions")
    async def completions() -> None:
        raise EngineSleepingError()

    register_operation_routes(app, engine)  # type: ignore[arg-type]
    return TestClient(app), engine


def test_no_operation_routes_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = _client(monkeypatch, "", None)
    for method, path in ROUTES + PROFILE_ROUTES:
        assert client.request(method, path).status_code == 404, path


def test_profile_routes_without_dev_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    client, engine = _client(monkeypatch, "0", "torch")
    assert client.post("/start_profile").status_code == 200
    assert client.post("/stop_profile").json() == {"traces": ["trace.json"]}
    assert engine.calls == [("start_profile",), ("stop_profile",)]
    assert client.post("/sleep").status_code == 404


def test_dev_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    client, engine = _client(monkeypatch, "1", None)
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")]).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    body = {"method": "echo", "args": [1], "kwargs": {"k": 2}, "timeout": 5}
    assert client.post("/collective_rpc", json=body).json() == {"results": 3}
    assert client.post("/update_weights_from_disk", json={"path": "/ckpt"}).json() == {"loaded": 3}
    assert client.post("/update_weights", json={"update_info": {"names": []}}).json() == {"loaded": 3}
    assert (
        client.post("/init_weight_transfer_engine", json={"init_info": {"master_port": 1}}).status_code == 200
    )
    assert engine.calls == [
        ("sleep", 2),
        ("wake_up", ["weights", "kv_cache"]),
        ("collective_rpc", "echo", [1], {"k": 2}, 5.0),
        ("update_weights_from_disk", "/ckpt"),
        ("update_weights", {"names": []}),
        ("init_weight_transfer_engine", {"master_port": 1}),
    ]
    assert client.post("/start_profile").status_code == 404


def test_errors_in_openai_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = _client(monkeypatch, "1", None)
    response = client.post("/collective_rpc", json={"method": "fail"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "bad method"
    response = client.post("/v1/completions")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "EngineSleepingError"
