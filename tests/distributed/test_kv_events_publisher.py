"""The ZMQ KV event publisher against a subscriber written for vLLM: frames, sequence numbers, replay."""

from __future__ import annotations

import ipaddress
import socket
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq
from kv_event_subscriber import BlockRemoved, BlockStored, Subscriber

from pagedllm.config.kv_transfer import KVEventsConfig
from pagedllm.core.kv_events import AllBlocksCleared, KVEventRecorder
from pagedllm.distributed.kv_events import (
    EventPublisher,
    ZmqEventPublisher,
    make_event_publisher,
    offset_endpoint,
)


def _events(i: int) -> list:
    recorder = KVEventRecorder(block_size=2)
    recorder.record_stored([bytes([i]) * 16], None, [i, i + 1])
    recorder.record_removed([bytes([i]) * 16])
    return recorder.take_events()


def test_batches_arrive_in_order_with_contiguous_sequence_numbers_and_replay(tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, topic="kv")
    publisher = make_event_publisher(config)
    assert isinstance(publisher, ZmqEventPublisher)
    sub = Subscriber(endpoint, "kv", replay)
    try:
        time.sleep(0.3)  # a SUB socket only sees messages sent after it joined
        for i in range(20):
            publisher.publish_events(_events(i))
        publisher.publish_events([])  # an idle step publishes nothing
        publisher.publish_events([AllBlocksCleared()])
        live = sub.receive()
        assert [seq for seq, _ in live] == list(range(21))
        first = live[0][1]
        assert first.data_parallel_rank == 0 and first.ts <= time.time()
        stored, removed = first.events
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        assert stored.token_ids == [0, 1] and stored.block_size == 2 and stored.medium == "GPU"
        assert stored.block_hashes == removed.block_hashes == [0]
        # A subscriber that missed batches 15.. asks for them again.
        replayed = sub.request_replay(15)
        assert [seq for seq, _ in replayed] == list(range(15, 21))
        assert replayed == live[15:]
    finally:
        sub.close()
        publisher.shutdown()


def test_wire_layout_is_a_positional_batch_of_events_as_maps_tagged_by_type(tmp_path: Path) -> None:
    """The layout README documents for subscribers without vLLM's structs (vLLM's current one): the
    batch a msgpack array, each event a map of its fields by name with "type" naming it, unset optional
    fields left out."""
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, topic="kv")
    publisher = make_event_publisher(config)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        publisher.publish_events(_events(3))
        # Asked from the replay socket (the live stream drops what a subscriber missed while joining),
        # again until the publisher's thread has sent the batch.
        payloads: list[bytes] = []
        deadline = time.monotonic() + 60
        while not payloads and time.monotonic() < deadline:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while dealer.poll(5000):
                _, _, payload = dealer.recv_multipart()
                if not payload:
                    break
                payloads.append(payload)
        (payload,) = payloads
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank == 0
        stored, removed = events
        assert stored == {
            "type": "BlockStored",
            "block_hashes": stored["block_hashes"],
            "parent_block_hash": None,
            "token_ids": [3, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        assert removed == {"type": "BlockRemoved", "block_hashes": stored["block_hashes"], "medium": "GPU", "group_idx": 0}
    finally:
        ctx.destroy(linger=0)
        publisher.shutdown()


def test_the_replay_buffer_keeps_the_last_buffer_steps_batches(tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(endpoint, replay, buffer_steps=3)
    sub = Subscriber(endpoint, "", replay)
    try:
        for i in range(6):
            publisher.publish_events(_events(i))
        deadline = time.monotonic() + 5
        while [seq for seq, _ in sub.request_replay(0)] != [3, 4, 5]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        sub.close()
        publisher.shutdown()


def test_null_and_disabled_configs_publish_nothing() -> None:
    for config in (None, KVEventsConfig(), KVEventsConfig(enable_kv_cache_events=True, publisher="null")):
        assert type(make_event_publisher(config)) is EventPublisher
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig().publisher == "null"


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/pub"
    first = ZmqEventPublisher(endpoint, replay_endpoint=endpoint + "-replay")
    try:
        with pytest.raises(ValueError, match="kv_events_config: cannot open"):
            ZmqEventPublisher("tcp://*:not-a-port")
    finally:
        first.shutdown()


def test_each_data_parallel_rank_publishes_on_its_own_endpoint() -> None:
    # vLLM's rule: a TCP port grows by the rank, other transports get a suffix; rank 0 keeps its own.
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _other_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (where another host would reach it)."""
    return [
        a.address
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]


def _listening_on(port: int) -> list[str]:
    """The addresses this process listens on at `port`."""
    connections = psutil.Process().net_connections("inet")
    return [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_default_endpoint_is_bound_on_loopback_only() -> None:
    """The events carry the token ids of cached prompts: by default only this machine reads them. A
    SUB socket on the loopback address gets every batch; one on another address of the machine (what
    another host reaches) gets nothing."""
    default = KVEventsConfig()
    assert default.endpoint == "tcp://127.0.0.1:5557" and default.replay_endpoint is None
    # The default address on a free port (5557 may be taken on a shared machine).
    endpoint = default.endpoint.replace(":5557", f":{_free_port()}")
    publisher = make_event_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    assert isinstance(publisher, ZmqEventPublisher)
    port = int(endpoint.rsplit(":", 1)[1])
    assert _listening_on(port) == ["127.0.0.1"]  # bound there, not connected
    local = Subscriber(endpoint)
    remote = [Subscriber(f"tcp://{address}:{port}") for address in _other_addresses()]
    try:
        time.sleep(0.3)  # a SUB socket only sees messages sent after it joined
        for i in range(5):
            publisher.publish_events(_events(i))
        assert [seq for seq, _ in local.receive()] == list(range(5))
        for sub in remote:
            assert sub.receive(idle_timeout_s=0.5) == []
    finally:
        for sub in (local, *remote):
            sub.close()
        publisher.shutdown()


def test_wildcard_and_local_addresses_bind_and_other_hosts_connect() -> None:
    """Binding every interface stays the operator's explicit choice (`*`); an address of another machine
    (a relay) is connected to."""
    port = _free_port()
    wildcard = ZmqEventPublisher(f"tcp://*:{port}")
    try:
        assert _listening_on(port) == ["0.0.0.0"]
    finally:
        wildcard.shutdown()
    relay = ZmqEventPublisher(f"tcp://192.0.2.123:{port}")  # TEST-NET-1: never this machine
    try:
        assert _listening_on(port) == []  # connecting, nothing bound
    finally:
        relay.shutdown()
