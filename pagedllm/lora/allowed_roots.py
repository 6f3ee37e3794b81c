"""`lora_config.lora_allowed_roots` (`--lora-allowed-roots DIR...`): when set, an adapter is read only
from under one of those directories, whoever names it (`--lora-modules`, `/v1/load_lora_adapter`, an
offline `LoRARequest`).

The adapter directory and each file the loader reads are resolved (symbolic links followed, `..`
collapsed) before anything is opened: a path that leaves the roots by `..` or through a link is refused,
naming `lora_path` and the roots' flag, never the file's content or whether it exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedllm.errors import RequestError
from pagedllm.lora.peft_loader import ADAPTER_FILES


def check_adapter_path(path: str, allowed_roots: Sequence[str] | None) -> str:
    """`path` if the adapter there lies under `allowed_roots` (None: anywhere); RequestError otherwise."""
    if allowed_roots is None:
        return path
    roots = [Path(root).expanduser().resolve() for root in allowed_roots]
    adapter = Path(path).expanduser()
    read = [adapter, *(adapter / name for name in ADAPTER_FILES)]
    outside = [p for p in read if not any(p.resolve().is_relative_to(root) for root in roots)]
    if outside:
        raise RequestError(
            "lora_path",
            f"lora_path {path!r} is not under the directories adapters may be read from "
            "(--lora-allowed-roots; '..' and links are resolved first)",
        )
    return path
