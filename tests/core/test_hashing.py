"""Block hashes: chaining, extra keys, canonical CBOR, and the same values in every process."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys

import pytest
import xxhash

from pagedllm.config import CacheConfig
from pagedllm.core.hashing import (
    HASH_ALGOS,
    NONE_HASH,
    cbor_encode,
    get_hash_function,
    get_request_block_hasher,
    hash_block_tokens,
)
from pagedllm.core.request import Request
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


def make_request(tokens: list[int], algo: str = "sha256", block_size: int = 4, lora: int = 0) -> Request:
    cc = CacheConfig(block_size=block_size, prefix_caching_hash_algo=algo)  # type: ignore[arg-type]
    return Request(
        "r",
        tokens,
        SamplingParams(max_tokens=4),
        None,
        lora_request=LoRARequest(f"l{lora}", lora, "/l") if lora else None,
        block_hasher=get_request_block_hasher(cc),
    )


@pytest.mark.parametrize(
    "value,encoded",
    [  # RFC 8949 appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (100, "1864"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (18446744073709551615, "1bffffffffffffffff"),
        (-1, "20"),
        (-1000, "3903e7"),
        (b"", "40"),
        (b"\x01\x02\x03\x04", "4401020304"),
        ("a", "6161"),
        ("\u00fc", "62c3bc"),
        ((), "80"),
        ((1, 2, 3), "83010203"),
        ([1, [2, 3], [4, 5]], "8301820203820405"),
        (None, "f6"),
        (True, "f5"),
        (False, "f4"),
    ],
)
def test_cbor_matches_rfc_examples(value: object, encoded: str) -> None:
    assert cbor_encode(value).hex() == encoded


def test_cbor_rejects_unsupported_types() -> None:
    with pytest.raises(TypeError, match="float"):
        cbor_encode((1, 2.5))
    with pytest.raises(ValueError, match="does not fit"):
        cbor_encode(2**64)


def test_unknown_algo_is_an_error() -> None:
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='md5' is not supported"):
        get_hash_function("md5")


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_chaining_and_extra_keys(algo: str) -> None:
    h = get_hash_function(algo)
    a = hash_block_tokens(h, None, [1, 2, 3, 4])
    assert a == hash_block_tokens(h, NONE_HASH, (1, 2, 3, 4))
    assert len(a) == (32 if algo.startswith("sha256") else 16)
    # Same tokens under a different parent, or with a LoRA id, are different blocks.
    assert hash_block_tokens(h, a, [1, 2, 3, 4]) != a
    assert hash_block_tokens(h, None, [1, 2, 3, 4], (7,)) != a
    assert hash_block_tokens(h, None, [1, 2, 3, 5]) != a


def test_request_hashes_only_full_blocks_incrementally() -> None:
    req = make_request(list(range(10)))
    assert len(req.block_hashes) == 2  # 10 tokens: 2 full blocks of 4, 2 tokens left
    whole = make_request(list(range(13)))
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11, 12])
    assert req.block_hashes == whole.block_hashes[:3] and len(whole.block_hashes) == 3
    # The chain: a block's hash depends on the whole prefix.
    other = make_request([99] + list(range(1, 13)))
    assert all(x != y for x, y in zip(other.block_hashes, whole.block_hashes))
    assert make_request(list(range(13)), lora=3).block_hashes[0] != whole.block_hashes[0]


def test_no_hasher_without_prefix_caching() -> None:
    assert get_request_block_hasher(CacheConfig(enable_prefix_caching=False)) is None


_CHILD = """
import json, sys
from types import SimpleNamespace
from pagedllm.core.hashing import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
out = {}
for algo in sys.argv[1:]:
    # The attributes of a CacheConfig (importing pagedllm.config would take seconds).
    cc = SimpleNamespace(block_size=4, prefix_caching_hash_algo=algo, enable_prefix_caching=True)
    r = Request("r", list(range(40)), SamplingParams(max_tokens=1), None,
                lora_request=LoRARequest("l", 2, "/l"),
                block_hasher=get_request_block_hasher(cc))
    out[algo] = [h.hex() for h in r.block_hashes]
print(json.dumps(out))
"""


def test_hashes_are_identical_across_processes() -> None:
    # This process runs with a random str-hash seed; the child with a fixed one.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *HASH_ALGOS], env=env, capture_output=True, text=True, check=True
    )
    here = {
        algo: [h.hex() for h in make_request(list(range(40)), algo=algo, lora=2).block_hashes]
        for algo in HASH_ALGOS
    }
    assert json.loads(proc.stdout) == here
    assert all(len(v) == 10 for v in here.values())
    # The documented formats: a digest of the pickled / CBOR-encoded (parent, tokens, extra keys) tuple.
    first = (NONE_HASH, tuple(range(4)), (2,))
    assert here["sha256"][0] == hashlib.sha256(pickle.dumps(first, protocol=5)).hexdigest()
    assert here["sha256_cbor"][0] == hashlib.sha256(cbor_encode(first)).hexdigest()
    assert here["xxhash_cbor"][0] == xxhash.xxh3_128_hexdigest(cbor_encode(first))
