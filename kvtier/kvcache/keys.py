"""Chained, salted block keys.

    root  = H(b"kvtier-root", extra)            extra = len(fingerprint), fingerprint, cache salt
    key_0 = H(root, tokens[0:bs])
    key_i = H(key_{i-1}, tokens[i*bs:(i+1)*bs])

A key names a block's content *and* everything before it, so equal keys mean equal KV for the
same model and configuration. Keys are 16-byte blake2b digests (128 bits): collisions are not a
practical concern. Because the first link hashes the root, blocks of different salts or models
never share a key and never meet in the index.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

KEY_BYTES = 16
BlockKey = bytes


def root_key(fingerprint: bytes, cache_salt: str | None = None) -> BlockKey:
    """The virtual parent of every first block for one model configuration and salt."""
    h = hashlib.blake2b(b"kvtier-root\x00", digest_size=KEY_BYTES)
    h.update(len(fingerprint).to_bytes(8, "little"))  # length first: (fp, salt) pairs stay distinct
    h.update(fingerprint)
    if cache_salt is not None:
        h.update(b"\x01salt\x00")
        h.update(cache_salt.encode("utf-8"))
    return h.digest()


def block_key(parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
    """Key of one full block given its parent's key (or the root key for the first block)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def hash_id_key(parent: BlockKey, hash_id: int) -> BlockKey:
    """Key of a block known only by an opaque id (trace replay: Mooncake `hash_ids`)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(b"\x02id")
    h.update(int(hash_id).to_bytes(8, "little", signed=True))
    return h.digest()


def chain_keys(parent: BlockKey, tokens: Sequence[int], block_size: int,
               start_block: int = 0, num_blocks: int | None = None) -> list[BlockKey]:
    """Keys of full blocks start_block, start_block+1, ... of `tokens`.

    `parent` is the key of block start_block-1 (or the root key when start_block is 0).
    """
    total = len(tokens) // block_size
    end = total if num_blocks is None else min(total, start_block + num_blocks)
    keys: list[BlockKey] = []
    for i in range(start_block, end):
        parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys
