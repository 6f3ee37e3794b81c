"""KV connectors: moving KV cache blocks between the engine's pool and somewhere else (a second tier on
host memory or disk, a directory shared with another instance), in the shape of vLLM's V1 connectors."""

from pagedllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedllm.distributed.kv_transfer.factory import create_connector, registered_connectors

__all__ = ["KVConnectorBase", "KVConnectorRole", "create_connector", "registered_connectors"]
