"""The scheduler's view of a KV connector matches what the connectors implement."""

from __future__ import annotations

import inspect

from pagedllm.core.kv_connector import SchedulerConnector
from pagedllm.distributed.kv_transfer import KVConnectorBase


def test_the_connector_base_implements_the_schedulers_protocol() -> None:
    methods = [name for name in vars(SchedulerConnector) if not name.startswith("_")]
    assert len(methods) == 6
    for name in methods:
        expected = inspect.signature(getattr(SchedulerConnector, name))
        assert inspect.signature(getattr(KVConnectorBase, name)) == expected, name
