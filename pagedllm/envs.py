"""Every environment variable pagedllm reads, in one registry: name, type, default and meaning.

Read a variable as an attribute (`envs.PAGEDLLM_CACHE_ROOT`): the value is parsed from `os.environ` at
each access, so a test or a launcher that sets a variable later is seen. Nothing in pagedllm writes
`os.environ` to pass a decision on; decisions live in the config. `describe()` lists
them with their current values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")


def _flag(raw: str | None) -> bool | None:
    """Tri-state boolean: unset or empty -> None, "1"/"true"/"yes"/"on" -> True, anything else False."""
    if raw is None or raw == "":
        return None
    return raw.strip().lower() in _TRUE


def _str(raw: str | None) -> str | None:
    return raw or None


def _int(raw: str | None) -> int | None:
    """Unset or empty -> None; otherwise the integer (ValueError for anything else)."""
    if raw is None or raw.strip() == "":
        return None
    return int(raw)


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str | None], Any]
    doc: str

    def read(self) -> Any:
        return self.parse(os.environ.get(self.name))


_VARS: list[EnvVar] = [
    EnvVar(
        "PAGEDLLM_CACHE_ROOT",
        _str,
        "Directory of pagedllm's on-disk caches (compiled graphs, native kernels, converted tokenizers); "
        "default $XDG_CACHE_HOME/pagedllm or ~/.cache/pagedllm.",
    ),
    EnvVar("XDG_CACHE_HOME", _str, "Base of the default cache root when PAGEDLLM_CACHE_ROOT is unset."),
    EnvVar(
        "PAGEDLLM_API_KEY",
        _str,
        "API key the server requires on every route but /health, /version and /metrics when --api-key is "
        "not given.",
    ),
    EnvVar(
        "PAGEDLLM_SERVER_DEV_MODE",
        _flag,
        "Expose the server's development routes (/sleep, /wake_up, /is_sleeping, /collective_rpc, weight "
        "updates, /reset_prefix_cache): never on a server reachable by untrusted clients (on a non-loopback "
        "--host the server refuses to start without --allow-dev-mode-remote).",
    ),
    EnvVar(
        "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING",
        _flag,
        "Expose POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora), as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING.",
    ),
    EnvVar(
        "PAGEDLLM_BATCH_INVARIANT",
        _flag,
        "Batch-invariant execution: a request's results do not depend on which other requests share "
        "its steps (disables cascade attention; see the README's reproducibility section).",
    ),
    EnvVar(
        "PAGEDLLM_USE_BREAKABLE_CUDAGRAPH",
        _flag,
        "Force breakable CUDA graphs on (1) or off (0); unset: the platform's architecture list decides.",
    ),
    EnvVar(
        "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN",
        _flag,
        "Allow max_model_len above what the model's config derives (outputs may be wrong past it).",
    ),
    EnvVar(
        "PAGEDLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE",
        _flag,
        "Keep the hybrid KV cache manager with chunked local attention (latency regression possible).",
    ),
    EnvVar("PAGEDLLM_USE_SIMPLE_KV_OFFLOAD", _flag, "Use the simple CPU KV offloading connector."),
    EnvVar(
        "PAGEDLLM_DEBUG_DUMP_PATH",
        _str,
        "Directory for compilation debug dumps; overrides compilation_config.debug_dump_path.",
    ),
    EnvVar(
        "PAGEDLLM_WORKER_MULTIPROC_METHOD",
        _str,
        "Start method of worker processes (fork or spawn); some models need spawn.",
    ),
    EnvVar(
        "PAGEDLLM_XGRAMMAR_CACHE_MB",
        _int,
        "Bound of the engine's compiled-grammar cache in MiB (both grammar engines; least recently used "
        "grammars are evicted), as vLLM's VLLM_XGRAMMAR_CACHE_MB; default 512.",
    ),
    EnvVar(
        "PAGEDLLM_GRAMMAR_COMPILE_MEMORY_MB",
        _int,
        "Memory in MiB a grammar compile (or check) worker process may allocate beyond what it starts "
        "with; a grammar needing more fails and its worker is replaced. Default 2048; 0: unbounded.",
    ),
    EnvVar(
        "PAGEDLLM_PP_LAYER_PARTITION",
        _str,
        "Layers per pipeline stage, comma-separated (e.g. 5,5,6); unset: as even as possible.",
    ),
    EnvVar(
        "PAGEDLLM_USE_V2_MODEL_RUNNER",
        _flag,
        "Force the second-generation model runner on (1) or off (0); unset: the config decides.",
    ),
    EnvVar(
        "PAGEDLLM_TRACE_FUNCTION",
        _flag,
        "Log every Python call of the engine's threads to a file under the temp directory (debugging).",
    ),
    EnvVar("TORCH_COMPILE_DISABLE", _flag, "torch's own switch: no torch.compile anywhere (forces -O0)."),
    EnvVar("USER", _str, "User name, for per-user paths of debug traces (USERNAME on Windows)."),
    EnvVar("USERNAME", _str, "User name where USER is unset."),
    EnvVar("HF_HUB_OFFLINE", _flag, "Never contact the Hugging Face Hub (huggingface_hub's own variable)."),
    EnvVar("CC", _str, "C compiler for the native CPU kernels; default cc, then gcc, then clang."),
    EnvVar(
        "PAGEDLLM_KERNEL_ISA",
        _str,
        "Flag set of the native CPU kernels: native, avx512-bf16, avx512, avx2 or portable (one this CPU "
        "runs); unset or auto: the best that builds.",
    ),
    EnvVar(
        "PYTORCH_CUDA_ALLOC_CONF",
        _str,
        "torch's CUDA allocator options; read to refuse expandable segments with KV connectors.",
    ),
    EnvVar("NCCL_GRAPH_REGISTER", _str, "NCCL's buffer registration in graphs; read to warn when it is on."),
    EnvVar("CUDA_VISIBLE_DEVICES", _str, "GPUs this process may use; data parallel cores split them."),
    EnvVar("OMP_NUM_THREADS", _str, "OpenMP threads; when unset the CPU worker sets torch's thread count."),
    EnvVar(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        _str,
        "OpenTelemetry's OTLP protocol for request traces: grpc (default) or http/protobuf.",
    ),
    EnvVar("WORLD_SIZE", _str, "Ranks a launcher (torchrun) started; read by the external_launcher backend."),
    EnvVar("RANK", _str, "This process's global rank, set by the launcher (external_launcher backend)."),
    EnvVar("LOCAL_RANK", _str, "This process's rank on its node, set by the launcher (external_launcher)."),
]

REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def __getattr__(name: str) -> Any:
    var = REGISTRY.get(name)
    if var is None:
        raise AttributeError(f"module 'pagedllm.envs' has no attribute {name!r} (not a registered variable)")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *REGISTRY])


def is_set(name: str) -> bool:
    """Whether the registered variable `name` is present in the environment (even if empty)."""
    if name not in REGISTRY:
        raise KeyError(f"{name} is not a registered environment variable")
    return name in os.environ


def describe() -> list[tuple[str, str, str]]:
    """(name, current raw value or '', doc) for every registered variable."""
    return [(v.name, os.environ.get(v.name, ""), v.doc) for v in _VARS]
