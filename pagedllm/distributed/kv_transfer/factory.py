"""The registry of KV connectors by `kv_transfer_config.kv_connector` name (vLLM's names).

Connectors that need hardware or packages pagedllm does not use (NIXL, NCCL peer-to-peer, LMCache) are
not registered: the config gate (`config/support.py`) names them as unsupported before an engine starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.kv_cache_interface import KVCacheSpec

# name -> "module:class", imported on use (a connector's module may pull in what others never need).
_REGISTRY: dict[str, str] = {
    "SharedStorageConnector": "pagedllm.distributed.kv_transfer.shared_storage:SharedStorageConnector",
    "OffloadingConnector": "pagedllm.distributed.kv_transfer.offloading:OffloadingConnector",
    # vLLM's simpler CPU offloader (PAGEDLLM_USE_SIMPLE_KV_OFFLOAD): the same tier serves both names.
    "SimpleCPUOffloadConnector": "pagedllm.distributed.kv_transfer.offloading:OffloadingConnector",
    "MultiConnector": "pagedllm.distributed.kv_transfer.multi:MultiConnector",
}


def registered_connectors() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def connector_class(name: str) -> type[KVConnectorBase]:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(
            f"kv_transfer_config.kv_connector={name!r} is not supported; choose one of {', '.join(_REGISTRY)}"
        )
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def make_connector(
    name: str, engine_config: EngineConfig, role: KVConnectorRole, spec: KVCacheSpec, extra_config: Mapping[str, Any]
) -> KVConnectorBase:
    return connector_class(name)(engine_config, role, spec, extra_config)


def create_connector(engine_config: EngineConfig, role: KVConnectorRole, spec: KVCacheSpec) -> KVConnectorBase | None:
    """The configured connector for one side, or None when none is configured (or the model keeps no
    KV cache: there is nothing to move)."""
    kv = engine_config.kv_transfer_config
    if kv is None or kv.kv_connector is None or spec.num_layers == 0:
        return None
    if not engine_config.cache_config.enable_prefix_caching:
        raise ValueError(
            f"kv_transfer_config.kv_connector={kv.kv_connector!r} finds blocks by their prefix-cache hashes: "
            "it needs enable_prefix_caching=True"
        )
    return make_connector(kv.kv_connector, engine_config, role, spec, kv.kv_connector_extra_config)
