"""Model source resolution for Hub repo ids, with `huggingface_hub.snapshot_download` replaced by a
recorder: HF_HUB_OFFLINE, revision and download_dir reach it, failures name the repo and the local
alternative, and the weight patterns follow the safetensors index. No test touches the network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from pagedllm.formats.model_source import download_model_files, hub_weight_patterns, resolve_model_source


class FakeHub:
    """Stands in for `snapshot_download`: records each call, returns `snapshot` or raises `error`."""

    def __init__(self, snapshot: Path | None = None, error: Exception | None = None) -> None:
        self.snapshot = snapshot
        self.error = error
        self.calls: list[dict[str, Any]] = []

    def __call__(self, repo_id: str, **kwargs: Any) -> str:
        self.calls.append({"repo_id": repo_id, **kwargs})
        if self.error is not None:
            raise self.error
        assert self.snapshot is not None
        return str(self.snapshot)


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    hub = FakeHub(snapshot)
    monkeypatch.setattr("huggingface_hub.snapshot_download", hub)
    return hub


@pytest.mark.parametrize(("env", "offline"), [(None, False), ("1", True), ("0", False), ("true", True)])
def test_offline_flag_revision_and_download_dir_reach_the_hub(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, env: str | None, offline: bool
) -> None:
    if env is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", env)
    source = resolve_model_source("someorg/some-model", revision="v2", download_dir="/tmp/dl")
    assert (
        source.kind == "hub" and source.repo_id == "someorg/some-model" and source.path == fake_hub.snapshot
    )
    (call,) = fake_hub.calls
    assert call["repo_id"] == "someorg/some-model"
    assert call["revision"] == "v2" and call["cache_dir"] == "/tmp/dl"
    assert call["local_files_only"] is offline
    # Config time fetches metadata only, never weights.
    assert "*.json" in call["allow_patterns"]
    assert not any("safetensors" in p or "gguf" in p for p in call["allow_patterns"])


@pytest.mark.parametrize(("env", "why"), [("1", "HF_HUB_OFFLINE is set"), ("0", "the Hub is unreachable")])
def test_unreachable_repo_names_it_and_the_local_alternative(
    monkeypatch: pytest.MonkeyPatch, env: str, why: str
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", env)
    monkeypatch.setattr("huggingface_hub.snapshot_download", FakeHub(error=LocalEntryNotFoundError("no")))
    with pytest.raises(ValueError) as info:
        download_model_files("someorg/some-model", "v3", None, ["*.json"])
    message = str(info.value)
    assert "'someorg/some-model' (revision v3)" in message and why in message
    assert "hf download someorg/some-model" in message and "model=<path>" in message


def test_invalid_repo_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.snapshot_download", FakeHub(error=AssertionError("not called")))
    with pytest.raises(ValueError, match="neither an existing local path nor a Hub repo id"):
        resolve_model_source("a/b/c")


def test_hub_repo_without_config(fake_hub: FakeHub) -> None:
    (fake_hub.snapshot / "config.json").unlink()  # type: ignore[operator]
    with pytest.raises(ValueError, match="Hub repo 'org/gguf-only' has no config.json"):
        resolve_model_source("org/gguf-only")


def test_weight_patterns_follow_the_index(tmp_path: Path) -> None:
    assert hub_weight_patterns(tmp_path) == ["*.safetensors"]
    second, first = "model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"
    weight_map = {"a": second, "b": first, "c": second}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # Only the indexed shards: a repo's extra consolidated.safetensors is not downloaded.
    assert hub_weight_patterns(tmp_path) == [first, second]
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    assert hub_weight_patterns(tmp_path) == ["*.safetensors"]
