import json

import pytest

from pagedllm.benchmarks.datasets import chat_requests, parse_range, random_requests


def test_parse_range():
    assert parse_range("128") == (128, 128)
    assert parse_range("128..512") == (128, 512)
    with pytest.raises(ValueError, match="LOW..HIGH"):
        parse_range("512..128")


def test_random_requests_lengths_and_specials():
    reqs = random_requests(50, (4, 9), output_len=7, vocab_size=20, seed=3, special_ids=(0, 1, 2))
    assert len(reqs) == 50
    assert all(4 <= r.prompt_len <= 9 and r.output_len == 7 for r in reqs)
    assert all(3 <= t < 20 for r in reqs for t in r.prompt_token_ids)
    # Same seed, same workload: both engines of a comparison see identical prompts.
    again = random_requests(50, (4, 9), output_len=7, vocab_size=20, seed=3, special_ids=(0, 1, 2))
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in again]


def test_chat_requests_cycles_and_validates(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = chat_requests(path, 5, output_len=4)
    assert [r.messages[0]["content"] for r in reqs] == ["q0", "q1", "q2", "q0", "q1"]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="messages"):
        chat_requests(path, None, 4)
