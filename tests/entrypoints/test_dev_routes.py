"""Which operation routes the server registers (no server, no engine): none by default, the profiler
routes only with a profiler configured, the rest only with PAGEDLLM_SERVER_DEV_MODE=1; and how their
errors answer (400 for bad arguments, 503 while the engine sleeps), in OpenAI's error shape."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from serve_startup import refused_before_the_engine

from pagedllm.engine.utility import EngineSleepingError
from pagedllm.entrypoints.openai.api_server import check_dev_mode_host
from pagedllm.entrypoints.openai.dev_routes import RPC_METHODS, register_operation_routes
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response
from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware

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
        if method == "collective_rpc" and args[1] == ["fail"]:
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
    body = {"method": "update_weights_from_disk", "args": [1], "kwargs": {"k": 2}, "timeout": 5}
    assert client.post("/collective_rpc", json=body).json() == {"results": 3}
    assert client.post("/update_weights_from_disk", json={"path": "/ckpt"}).json() == {"loaded": 3}
    assert client.post("/update_weights", json={"update_info": {"names": []}}).json() == {"loaded": 3}
    assert (
        client.post("/init_weight_transfer_engine", json={"init_info": {"master_port": 1}}).status_code == 200
    )
    assert engine.calls == [
        ("sleep", 2),
        ("wake_up", ["weights", "kv_cache"]),
        ("collective_rpc", "update_weights_from_disk", [1], {"k": 2}, 5.0),
        ("update_weights_from_disk", "/ckpt"),
        ("update_weights", {"names": []}),
        ("init_weight_transfer_engine", {"master_port": 1}),
    ]
    assert client.post("/start_profile").status_code == 404


def test_errors_in_openai_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = _client(monkeypatch, "1", None)
    response = client.post("/collective_rpc", json={"method": "update_weights", "args": ["fail"]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "bad method"
    response = client.post("/v1/completions")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "EngineSleepingError"


def test_collective_rpc_takes_only_allowed_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker methods outside `RPC_METHODS` (the step, start-up, shutdown, LoRA loading that skips its
    route's checks) are a 400 naming `method`, and never reach the engine."""
    client, engine = _client(monkeypatch, "1", None)
    for method in ("execute_model", "shutdown", "load_model", "initialize_kv_cache", "add_lora", "__init__"):
        response = client.post("/collective_rpc", json={"method": method, "args": []})
        assert response.status_code == 400, method
        assert response.json()["error"]["param"] == "method"
        assert method in response.json()["error"]["message"]
    assert engine.calls == []
    for method in RPC_METHODS:
        assert client.post("/collective_rpc", json={"method": method}).status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_dev_mode_refuses_a_remote_host(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", "1")
    with pytest.raises(ValueError, match=f"--host {host}.*--allow-dev-mode-remote"):
        check_dev_mode_host(host, allow_remote=False)
    check_dev_mode_host(host, allow_remote=True)
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", "0")
    check_dev_mode_host(host, allow_remote=False)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_dev_mode_on_loopback_starts(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", "1")
    check_dev_mode_host(host, allow_remote=False)


def test_serve_in_dev_mode_on_every_interface_fails_before_the_engine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`pagedllm serve --host 0.0.0.0` in dev mode: status 2 with the reason, no engine created."""
    monkeypatch.setenv("PAGEDLLM_SERVER_DEV_MODE", "1")
    log = refused_before_the_engine(["--host", "0.0.0.0"], monkeypatch, caplog)
    assert "reachable from other machines" in log and "--allow-dev-mode-remote" in log


def _keyed_app() -> TestClient:
    app = FastAPI()
    for path in ("/health", "/version", "/metrics", "/pooling", "/score", "/rerank", "/v1/score", "/sleep"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.add_middleware(ApiKeyMiddleware, api_key="k")
    return TestClient(app)


def test_api_key_covers_every_route_but_the_probes() -> None:
    client = _keyed_app()
    for path in ("/pooling", "/score", "/rerank", "/v1/score", "/sleep", "/docs", "/openapi.json", "/nothing"):
        assert client.post(path).status_code == 401, path
        assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert client.post("/pooling", headers={"Authorization": "Bearer k"}).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert client.get(path).status_code == 200, path
    # The probe paths are open exactly: nothing is reachable through them.
    assert client.get("/health/../sleep").status_code == 401
