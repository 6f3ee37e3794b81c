"""Chained hashes of full KV cache blocks, the keys of the prefix cache.

A block's hash covers its parent block's hash, its own token ids and extra keys (the LoRA id), so equal
hashes mean equal whole prefixes, not just equal blocks. Every hash must be the same in every process
(the engine core may restart, and tests compare runs), so nothing here uses Python's randomized
`hash()`; the inputs are serialized canonically and digested:

- "sha256": sha256 of a pickle (protocol 5) of the tuple. Pickling tuples of ints/bytes/None is
  deterministic (no dict or set ordering is involved).
- "sha256_cbor": sha256 of a canonical CBOR encoding (RFC 8949 deterministic encoding), which other
  languages can reproduce.
- "xxhash" / "xxhash_cbor": the same two serializations digested with xxh3_128, several times faster
  than sha256 and 128 bits wide (collisions stay negligible for a cache of millions of blocks), but
  not cryptographic: pick sha256 where tenants could craft colliding prompts.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.request import Request

# A block hash is a digest: 32 bytes (sha256) or 16 bytes (xxh3_128).
BlockHash = bytes
HashFunction = Callable[[Any], BlockHash]
# Extra keys that make equal token ids different cache entries (the LoRA adapter id).
ExtraKeys = tuple[Any, ...] | None

# The parent of a request's first block: a fixed value (not random) so hashes agree across processes.
NONE_HASH: BlockHash = hashlib.sha256(b"pagedllm prefix cache root").digest()

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head in its shortest form (deterministic encoding, RFC 8949 section 4.2.1)."""
    if value < 24:
        return bytes([major << 5 | value])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, value)
    raise ValueError(f"integer {value} does not fit in a CBOR head")


def cbor_encode(obj: Any) -> bytes:
    """Canonical CBOR of the values a block identity is made of: ints, bytes, str, None, bool and
    tuples/lists of them (anything else is rejected, so the encoding can never silently vary)."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(cbor_encode(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode a {type(obj).__name__} in a block hash")


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def get_hash_function(algo: str) -> HashFunction:
    """The digest function of `CacheConfig.prefix_caching_hash_algo`."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"prefix_caching_hash_algo={algo!r} is not supported; choose one of {HASH_ALGOS}")
    serialize = cbor_encode if algo.endswith("_cbor") else _pickle
    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(serialize(obj)).digest()
    try:
        import xxhash
    except ImportError as e:
        raise ValueError(
            f"prefix_caching_hash_algo={algo!r} needs the xxhash package (pip install xxhash)"
        ) from e
    return lambda obj: xxhash.xxh3_128_digest(serialize(obj))


def hash_block_tokens(
    hash_function: HashFunction,
    parent_block_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
) -> BlockHash:
    """The hash of one full block, chained to its parent (None for a request's first block)."""
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    return hash_function((parent_block_hash, tuple(block_token_ids), extra_keys))


def request_extra_keys(request: Request) -> ExtraKeys:
    """Keys beside the tokens that change a block's KV content: the LoRA adapter."""
    return (request.lora_int_id,) if request.lora_int_id else None


RequestBlockHasher = Callable[["Request"], list[BlockHash]]


def get_request_block_hasher(cache_config: Any) -> RequestBlockHasher | None:
    """A function returning the hashes of a request's full blocks that are not hashed yet (each block
    is hashed exactly once, when it fills up); None when prefix caching is off (nothing to hash)."""
    if not cache_config.enable_prefix_caching:
        return None
    block_size: int = cache_config.block_size
    hash_function = get_hash_function(cache_config.prefix_caching_hash_algo)

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        if start + block_size > num_tokens:
            return []
        parent = request.block_hashes[-1] if request.block_hashes else None
        extra_keys = request_extra_keys(request)
        tokens = request.all_token_ids
        new_hashes: list[BlockHash] = []
        while start + block_size <= num_tokens:
            parent = hash_block_tokens(hash_function, parent, tokens[start : start + block_size], extra_keys)
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher
