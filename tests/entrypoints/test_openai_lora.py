"""LoRA adapters through a real server and the official openai client: static (--lora-modules, both
forms) and runtime-loaded adapters selected by `model`, their completions equal to HF PEFT's in one
mixed batch with the base model, /v1/models with `parent`, clear 400/404 errors (malformed adapters
included, on a connection that stays open), an in-use adapter not unloaded under its running request, and
the vllm:lora_requests_info gauge."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from peft_adapters import AdapterSpec, make_adapter, make_adapters, peft_greedy, peft_model  # noqa: E402
from remote_server import RemoteServer, on_one_connection  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from serve_startup import refused_before_the_engine  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

pytestmark = pytest.mark.slow
BASE = "tiny-base"
PROMPT = "The quick brown fox jumps over"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    paths = make_adapters(root)
    paths["rank32"] = make_adapter(paths["base"], root / "rank32", AdapterSpec(32, ["q_proj"]), 7)
    # Outside the server's --lora-allowed-roots (the directory above), and a link leading there.
    paths["outside"] = Path(shutil.copytree(paths["qv8"], tmp_path_factory.mktemp("not-allowed") / "qv8"))
    (root / "link").symlink_to(paths["outside"], target_is_directory=True)
    return paths


@pytest.fixture(scope="module")
def server(files: dict[str, Path]) -> Iterator[RemoteServer]:
    mlp = json.dumps({"name": "mlp16", "path": str(files["mlp16"]), "base_model_name": "tiny-llama-hf"})
    remote = RemoteServer(
        extra_args=[
            "--model",
            str(files["base"]),
            "--served-model-name",
            BASE,
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "16",
            "--dtype",
            "float32",
            "--lora-modules",
            f"qv8={files['qv8']}",
            mlp,
            "--lora-allowed-roots",
            str(files["base"].parent),
        ],
        env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    try:
        yield remote
    finally:
        remote.kill()


def _reference(files: dict[str, Path], name: str | None) -> tuple[str, list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(files["base"])
    prompt = tokenizer.encode(PROMPT)
    tokens, logprobs = peft_greedy(
        peft_model(files["base"], None if name is None else files[name]), prompt, MAX_TOKENS
    )
    return tokenizer.decode(tokens), logprobs


def _complete(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )


def _check(files: dict[str, Path], completion: openai.types.Completion, name: str | None) -> None:
    text, logprobs = _reference(files, name)
    choice = completion.choices[0]
    assert choice.text == text, name
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=2e-4)


def test_models_list_adapters_with_parent(client: openai.OpenAI, files: dict[str, Path]) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "qv8", "mlp16"}
    assert cards["qv8"].parent == BASE and cards["qv8"].root == str(files["qv8"])  # type: ignore[attr-defined]
    assert cards["mlp16"].parent == "tiny-llama-hf"  # type: ignore[attr-defined]


def test_mixed_batch_equals_peft(client: openai.OpenAI, files: dict[str, Path]) -> None:
    models = [BASE, "qv8", "mlp16", BASE, "qv8"]
    with ThreadPoolExecutor(len(models)) as pool:
        completions = list(pool.map(lambda m: _complete(client, m), models))
    for model, completion in zip(models, completions):
        assert completion.model == model
        _check(files, completion, None if model == BASE else model)
    with pytest.raises(openai.NotFoundError, match="nope"):
        _complete(client, "nope")


def test_runtime_load_and_unload(client: openai.OpenAI, server: RemoteServer, files: dict[str, Path]) -> None:
    url = server.url
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "all4", "lora_path": str(files["all4-rs"])}
    )
    assert r.status_code == 200, r.text
    _check(files, _complete(client, "all4"), "all4-rs")
    for body, status, words in (
        ({"lora_name": "all4", "lora_path": str(files["all4-rs"])}, 400, "already been loaded"),
        ({"lora_name": "gone", "lora_path": str(files["base"] / "nowhere")}, 400, "not a directory"),
        ({"lora_name": "big", "lora_path": str(files["rank32"])}, 400, "max_lora_rank=16"),
    ):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gone"})
    assert r.status_code == 404, r.text
    # Only from under --lora-allowed-roots: not elsewhere, not by '..', not through a link.
    root = files["base"].parent
    for path in (files["outside"], root / ".." / files["outside"].parent.name / "qv8", root / "link"):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "escape", "lora_path": str(path)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert "--lora-allowed-roots" in r.json()["error"]["message"]

    # An adapter in use is not unloaded: its running request finishes undisturbed.
    stream = client.completions.create(
        model="all4",
        prompt=PROMPT,
        max_tokens=480,  # long enough to still run when the unload arrives
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [next(iter(stream))]
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "all4"})
    metrics = httpx.get(f"{url}/metrics").text
    reader.join(120)
    assert r.status_code == 400 and "in use" in r.json()["error"]["message"], r.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish == ["length"] and usage is not None and usage.completion_tokens == 480
    info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert info and 'max_lora="2"' in info[0] and 'running_lora_adapters="all4"' in info[0], info
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "all4"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "all4")
    assert {m.id for m in client.models.list().data} == {BASE, "qv8", "mlp16"}


def test_malformed_adapters_are_400_naming_the_file(server: RemoteServer, files: dict[str, Path]) -> None:
    """Each a 400 naming the file and what is wrong (they were 500s, and each 500 closed the client's
    keep-alive connection); an all-NaN adapter is refused naming the tensor."""
    # Under the server's --lora-allowed-roots.
    malformed = files["base"].parent / "malformed"
    nan, truncated, config = (malformed / name for name in ("nan", "truncated", "config"))
    for path in (nan, truncated, config):
        shutil.copytree(files["qv8"], path)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    save_file(
        {**tensors, key: torch.full_like(tensors[key], float("nan"))}, str(nan / "adapter_model.safetensors")
    )
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    (config / "adapter_config.json").write_text("{")
    # (adapter directory, what the error names, what it says)
    cases = [
        (nan, str(nan), f"{key} holds NaN"),
        (truncated, str(weights), "cannot be read"),
        (config, str(config / "adapter_config.json"), "not valid JSON"),
    ]
    requests = [
        ("POST", "/v1/load_lora_adapter", {"lora_name": path.name, "lora_path": str(path)})
        for path, _, _ in cases
    ]
    answers = on_one_connection(server.url, [*requests, ("GET", "/v1/models", None)])
    for (status, body), (_, named, words) in zip(answers, cases):
        assert status == 400 and body["error"]["param"] == "lora_path", body
        assert named in body["error"]["message"] and words in body["error"]["message"], body
    assert answers[-1][0] == 200 and {m["id"] for m in answers[-1][1]["data"]} == {BASE, "qv8", "mlp16"}


def test_static_adapter_outside_the_roots_fails_before_loading_the_model(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    flags = ["--enable-lora", "--lora-allowed-roots", str(files["base"].parent)]
    log = refused_before_the_engine([*flags, "--lora-modules", f"x={files['outside']}"], monkeypatch, caplog)
    assert "--lora-modules x: lora_path" in log and "--lora-allowed-roots" in log
