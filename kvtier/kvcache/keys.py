"""Chained, salted block keys.

    root  = H(b"kvtier-root", extra)            extra = len(fingerprint), fingerprint, cache salt
    key_0 = H(root, tokens[0:bs])
    key_i = H(key_{i-1}, tokens[i*bs:(i+1)*bs])

A key names a block's content *and* everything before it, so equal keys mean equal KV for the
same model and configuration. Keys are 16-byte blake2b digests (128 bits): collisions are not a
practical concern. Because the first link hashes the root, blocks of different salts or models
never share a key and never meet in the index.

Runs (the failure domain of a shared store). The first 4 bytes of a key are its run tag: a
block inherits its parent's tag unless it starts a new run, so a chain is cut into runs of
consecutive blocks that share key[:4], and a Redis Cluster tier turns the tag into a hash tag
(one node per run, not one per block; docs/benchmarks.md "Redis Cluster failure domain"):

    chain    b0    b1    b2  ...  b40   b41 ...        key = tag (4 bytes) | digest[4:16]
    tag      t0    t0    t0  ...  t40   t40 ...        t40: b40 started a run

A block starts a run when its parent is a root (root keys begin with 4 zero bytes) or when its
own digest says so (digest[4:6] % RUN_BLOCKS == 0: content-defined, about one block in
RUN_BLOCKS). So the tag needs no chain position: `block_key(parent, tokens)` alone decides,
and every caller computes the same keys. Within a run, keys differ in their other 96 bits.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16
BlockKey = bytes
TAG_BYTES = 4
RUN_BLOCKS = 32
"""Mean run length in blocks (geometric): longer runs keep more of a chain readable when one
cluster master is lost, shorter ones spread keys more evenly over the masters (the trade-off is
measured by benchmarks/cluster_failure_domain.py, figures in docs/benchmarks.md)."""
_ROOT_TAG = bytes(TAG_BYTES)


def _in_run(parent: BlockKey, digest: bytes) -> BlockKey:
    """The key of a block with this digest: the parent's run tag, or its own when it starts one."""
    if parent[:TAG_BYTES] == _ROOT_TAG or int.from_bytes(digest[4:6], "little") % RUN_BLOCKS == 0:
        if digest[:TAG_BYTES] == _ROOT_TAG:  # one in 2^32: a block must not look like a root
            return b"\x00\x00\x00\x01" + digest[TAG_BYTES:]
        return digest
    return parent[:TAG_BYTES] + digest[TAG_BYTES:]


def root_key(fingerprint: bytes, cache_salt: str | None = None) -> BlockKey:
    """The virtual parent of every first block for one model configuration and salt."""
    h = hashlib.blake2b(b"kvtier-root\x00", digest_size=KEY_BYTES)
    h.update(len(fingerprint).to_bytes(8, "little"))  # length first: (fp, salt) pairs stay distinct
    h.update(fingerprint)
    if cache_salt is not None:
        h.update(b"\x01salt\x00")
        h.update(cache_salt.encode("utf-8"))
    return _ROOT_TAG + h.digest()[TAG_BYTES:]  # the zero tag marks a root (see Runs above)


def block_key(parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
    """Key of one full block given its parent's key (or the root key for the first block)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("q", tokens).tobytes())
    return _in_run(parent, h.digest())


def hash_id_key(parent: BlockKey, hash_id: int) -> BlockKey:
    """Key of a block known only by an opaque id (trace replay: Mooncake `hash_ids`)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(b"\x02id")
    h.update(int(hash_id).to_bytes(8, "little", signed=True))
    return _in_run(parent, h.digest())


def chain_keys(
    parent: BlockKey, tokens: Sequence[int], block_size: int, start_block: int = 0, num_blocks: int | None = None
) -> list[BlockKey]:
    """Keys of full blocks start_block, start_block+1, ... of `tokens`.

    `parent` is the key of block start_block-1 (or the root key when start_block is 0).
    """
    total = len(tokens) // block_size
    end = total if num_blocks is None else min(total, start_block + num_blocks)
    keys: list[BlockKey] = []
    for i in range(start_block, end):
        parent = block_key(parent, tokens[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys
