"""Paged KV bookkeeping: no tensors, no I/O (the simulator drives the same code)."""

from kvtier.kvcache.block_pool import Block, BlockCopy, BlockLoad, BlockPool, BlockToStore, NoFreeBlocksError
from kvtier.kvcache.keys import BlockKey, block_key, chain_keys, hash_id_key, root_key
from kvtier.kvcache.manager import KVCacheManager, PrefixMatch
from kvtier.kvcache.policy import LFUPolicy, LRUPolicy, make_policy
from kvtier.kvcache.prefix_index import CachedBlock, PrefixIndex

__all__ = [
    "Block",
    "BlockCopy",
    "BlockKey",
    "BlockLoad",
    "BlockPool",
    "BlockToStore",
    "CachedBlock",
    "KVCacheManager",
    "LFUPolicy",
    "LRUPolicy",
    "NoFreeBlocksError",
    "PrefixIndex",
    "PrefixMatch",
    "block_key",
    "chain_keys",
    "hash_id_key",
    "make_policy",
    "root_key",
]
