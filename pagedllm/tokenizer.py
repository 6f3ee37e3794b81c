"""Loading the tokenizer of a model: HF directories through AutoTokenizer, GGUF files from their metadata.

`AutoTokenizer.from_pretrained(dir, gguf_file=...)` takes ~6 s on the embedded SmolLM2 GGUF, most of it
building a model config from every GGUF field with `gguf.GGUFReader`, which a tokenizer does not need.
We call transformers' own GGUF tokenizer conversion directly (~1.5 s, the same tokenizer) and keep the
result in an on-disk cache keyed by the file's path, size and mtime (~0.3 s on later loads).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedllm.config.utils import cache_root
from pagedllm.errors import RequestError

if TYPE_CHECKING:
    from pagedllm.config.model import ModelConfig

# Bump when the cached files' layout or content changes.
_CACHE_FORMAT = 1
_TOKENIZER_FILE = "tokenizer.json"
_KWARGS_FILE = "tokenizer_kwargs.json"


def default_cache_dir() -> Path:
    return cache_root() / "tokenizers"


def get_tokenizer(
    model_config_or_path: ModelConfig | str | Path,
    gguf_file: str | Path | None = None,
    *,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    cache_dir: Path | None = None,
    **kwargs: Any,
) -> PreTrainedTokenizerBase:
    """The tokenizer of a model.

    ``model_config_or_path`` is a ModelConfig (its resolved ``tokenizer``, ``tokenizer_mode``,
    ``tokenizer_revision`` and ``trust_remote_code`` are used), a directory, a Hub id or a ``.gguf`` file;
    ``gguf_file`` names a GGUF inside the directory. The chat template is ``tokenizer.chat_template``
    (from tokenizer_config.json / chat_template.jinja, or the GGUF's ``tokenizer.chat_template``).
    Extra ``kwargs`` go to ``AutoTokenizer.from_pretrained``."""
    if not isinstance(model_config_or_path, str | Path):
        mc = model_config_or_path
        if mc.tokenizer is None:
            raise ValueError("ModelConfig.tokenizer is not resolved; construct the ModelConfig first")
        path: str | Path = mc.tokenizer
        tokenizer_mode = mc.tokenizer_mode
        trust_remote_code = mc.trust_remote_code
        revision = mc.tokenizer_revision
        if mc.skip_tokenizer_init:
            raise ValueError("skip_tokenizer_init is set: this engine has no tokenizer")
    else:
        path = model_config_or_path
    if tokenizer_mode not in ("auto", "hf", "slow"):
        raise ValueError(f"tokenizer_mode={tokenizer_mode!r} is not supported (use 'auto', 'hf' or 'slow')")

    gguf_path = _resolve_gguf(Path(path), gguf_file)
    if gguf_path is not None:
        if tokenizer_mode == "slow":
            raise ValueError(
                "tokenizer_mode='slow' is not supported for GGUF models (their tokenizer is built fast)"
            )
        return load_gguf_tokenizer(gguf_path, cache_dir=cache_dir)
    return AutoTokenizer.from_pretrained(
        str(path),
        use_fast=tokenizer_mode != "slow",
        trust_remote_code=trust_remote_code,
        revision=revision,
        **kwargs,
    )


def _resolve_gguf(path: Path, gguf_file: str | Path | None) -> Path | None:
    if gguf_file is not None:
        gguf = Path(gguf_file)
        return gguf if gguf.is_absolute() else path / gguf
    if path.suffix == ".gguf" and path.is_file():
        return path
    return None


def load_gguf_tokenizer(gguf_path: Path, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """The fast tokenizer a GGUF file describes (vocabulary, merges, special tokens, chat template)."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    cache = (cache_dir or default_cache_dir()) / _cache_key(gguf_path)
    tokenizer_file, kwargs_file = cache / _TOKENIZER_FILE, cache / _KWARGS_FILE
    if tokenizer_file.is_file() and kwargs_file.is_file():
        init_kwargs = json.loads(kwargs_file.read_text())
        return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **init_kwargs)

    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, init_kwargs = get_gguf_tokenizer(str(gguf_path))
    backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
    init_kwargs = {**init_kwargs, **extra_kwargs}
    _write_cache(cache, backend.to_str(), init_kwargs)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs)


def _cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    ident = (
        f"{_CACHE_FORMAT}|{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _write_cache(cache: Path, tokenizer_json: str, init_kwargs: dict[str, Any]) -> None:
    """Write both files into a temporary directory and rename it into place, so that concurrent
    processes never read a half-written cache entry. A failure only costs the next load its speed."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-"))
        (tmp / _TOKENIZER_FILE).write_text(tokenizer_json)
        (tmp / _KWARGS_FILE).write_text(json.dumps(init_kwargs))
        try:
            tmp.rename(cache)
        except OSError:  # another process won the race: keep its entry
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    except OSError:
        pass


def resolve_chat_template(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | Path | None = None
) -> str | None:
    """The chat template to render with: an override (a template string or a path to a file holding one),
    else the tokenizer's own; None if neither exists."""
    if chat_template is None:
        return getattr(tokenizer, "chat_template", None)
    candidate = Path(chat_template) if isinstance(chat_template, Path) or "{" not in chat_template else None
    if candidate is not None:
        if not candidate.is_file():
            raise RequestError(
                "chat_template", f"chat_template {str(chat_template)!r} is neither a template nor a file"
            )
        return candidate.read_text()
    return str(chat_template)
