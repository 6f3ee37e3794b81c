"""`pagedllm serve --kv-events-config '{json}'` (as vLLM's flag): a real server process publishes the
blocks of a completion's prompt and the reset of its prefix cache to a vLLM-style subscriber."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import openai
import pytest
from kv_event_subscriber import AllBlocksCleared, BlockStored, Subscriber, cached_hashes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from remote_server import RemoteServer, free_port  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [(7 * i + 3) % 300 for i in range(40)]


def test_server_publishes_prompt_blocks_and_reset(two_tiny_llms: tuple[Path, Path]) -> None:
    pub_port, replay_port = free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv-events",
    }
    server = RemoteServer(
        extra_args=["--kv-events-config", json.dumps(events_config), "--dtype", "float32", str(two_tiny_llms[0])],
        env={"PAGEDLLM_SERVER_DEV_MODE": "1"},
    )
    sub = Subscriber(f"tcp://127.0.0.1:{pub_port}", "kv-events", f"tcp://127.0.0.1:{replay_port}")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
        assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).json() == {"reset": True}
        live = sub.receive(idle_timeout_s=1.0)
        # The SUB socket may have joined after the first batch: the replay endpoint has them all.
        replayed = sub.request_replay(0)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert live and replayed[-len(live) :] == live
        events = [e for _, b in replayed for e in b.events]
        stored = [e for e in events if isinstance(e, BlockStored)]
        bs = stored[0].block_size
        assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
        assert [t for e in stored for t in e.token_ids][: len(PROMPT) // bs * bs] == PROMPT[: len(PROMPT) // bs * bs]
        assert isinstance(events[-1], AllBlocksCleared)
        assert cached_hashes([b for _, b in replayed]) == set()
    finally:
        sub.close()
        server.kill()
