"""KV transfer (disaggregated prefill), KV cache events, encoder-cache transfer and its manager."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

# The connectors registered in `pagedllm.distributed.kv_transfer.factory` (vLLM's names); config/support.py
# refuses any other `kv_connector` before an engine starts.
KV_CONNECTORS = ("SharedStorageConnector", "OffloadingConnector", "SimpleCPUOffloadConnector", "MultiConnector")


@config
class KVTransferConfig:
    """Configuration of a KV connector."""

    kv_connector: str | None = None
    """Connector class name (e.g. NixlConnector, OffloadingConnector)."""
    kv_role: KVRole | None = None
    """Whether this instance produces KV, consumes it, or both."""
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    """Connector-specific options."""
    engine_id: str | None = None
    """Identity of this engine towards its peers."""

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role is not None

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def connector_names(self) -> list[str]:
        """The configured connector, or each of a MultiConnector's sub-connectors."""
        if self.kv_connector is None:
            return []
        if self.kv_connector == "MultiConnector":
            subs = self.kv_connector_extra_config.get("connectors", [])
            return ["MultiConnector"] + [str(sub.get("kv_connector")) for sub in subs]
        return [self.kv_connector]

    def has_connector(self, name: str) -> bool:
        return name in self.connector_names()

    def compute_hash(self) -> str:
        return hash_fields(self, ("kv_connector", "kv_role"))


@config
class KVEventsConfig:
    """Configuration of KV cache event publishing (blocks stored in / removed from the prefix cache)."""

    enable_kv_cache_events: bool = False
    """Record KV cache events (block stored / removed / all cleared) and hand them to the publisher."""
    publisher: Literal["null", "zmq"] | None = None
    """Event publisher: "zmq" publishes, "null" drops the events. Unset: "zmq" when events are enabled,
    "null" otherwise."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """ZMQ PUB endpoint of the events: an address of this machine (loopback by default; `*` for every
    interface), ipc:// or inproc:// binds, another machine's address connects. The events carry the
    token ids of cached prompts: whoever reaches a bound endpoint reads them."""
    replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint where subscribers ask for missed batches (from a sequence number on; always
    bound, e.g. tcp://127.0.0.1:5558); None: no replay."""
    buffer_steps: int = Field(default=10_000, ge=1)
    """How many of the latest event batches the replay endpoint keeps."""
    hwm: int = Field(default=100_000, ge=0)
    """ZMQ high-water mark of the PUB socket: batches beyond it are dropped for a slow subscriber."""
    max_queue_size: int = Field(default=100_000, ge=1)
    """Batches waiting for the publisher thread; when full, the engine step waits for room."""
    topic: str = ""
    """ZMQ topic of the events (the first frame of each message)."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    def compute_hash(self) -> str:
        return hash_fields(self, ())


@config
class ECTransferConfig:
    """Configuration of encoder-cache transfer (disaggregated multimodal encoder)."""

    ec_connector: str | None = None
    """Encoder-cache connector class name."""
    ec_role: Literal["ec_producer", "ec_consumer", "ec_both"] | None = None
    """Whether this instance produces encoder outputs, consumes them, or both."""
    ec_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    """Connector-specific options."""

    @property
    def is_encode_only(self) -> bool:
        return self.ec_role == "ec_producer"

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    def compute_hash(self) -> str:
        return hash_fields(self, ("ec_connector", "ec_role"))


@config
class EncoderCacheManagerConfig:
    """Configuration of the multimodal encoder-cache manager."""

    manager_cls: str | None = None
    """Fully qualified class name of a custom encoder-cache manager; unset: the built-in one."""

    def compute_hash(self) -> str:
        return hash_fields(self, ("manager_cls",))
