"""What names a vLLM block in kvtier's tiers: the fingerprint of the configuration its KV was
computed under, each rank's namespace, a request's salt (its tenant), and the request's chained
block keys (kvtier's own chain, kvtier/kvcache/keys.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.kvcache.keys import BlockKey, chain_keys, root_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def config_fingerprint(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bytes:
    """What KV computed under `vllm_config` depends on, as 16 bytes: the model and its weights'
    revision, dtypes, block size, the KV spec of every layer group, the parallel layout and the
    device kind (its attention backends lay blocks out differently). The same on every rank."""
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    parts = [
        "kvtier-vllm-1",
        f"model={mc.model}",
        f"revision={getattr(mc, 'revision', None)}",
        f"dtype={mc.dtype}",
        f"kv_dtype={cc.cache_dtype}",
        f"block={cc.block_size}",
        f"tp={pc.tensor_parallel_size}",
        f"pp={pc.pipeline_parallel_size}",
        f"device={current_platform.device_type}",
        f"layout={getattr(kv_cache_config, 'kv_cache_layout', None)}",
    ]
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        parts.append(
            f"group={type(spec).__name__}:{len(group.layer_names)}:"
            f"{getattr(spec, 'num_kv_heads', None)}:{getattr(spec, 'head_size', None)}:"
            f"{getattr(spec, 'dtype', None)}:{getattr(spec, 'page_size_bytes', None)}"
        )
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).digest()


def rank_fingerprint(fingerprint: bytes, rank: int) -> bytes:
    """The tier namespace of one rank's shard (each rank stores its own heads or layers)."""
    return hashlib.blake2b(fingerprint + b"rank" + rank.to_bytes(4, "little"), digest_size=16).digest()


def world_size(vllm_config: VllmConfig) -> int:
    """Ranks that each store a shard of every block."""
    pc = vllm_config.parallel_config
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def request_salt(request: Request) -> str | None:
    """The key salt of a request: vLLM's cache_salt, plus the LoRA adapter whose KV it is: its
    name and id, and the digest of its files (kvtier.lora.adapter_digest), so an adapter
    retrained and saved under the same name (another process, a restart, vLLM's load_inplace)
    never restores the old one's KV from the disk or Redis tier."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        from kvtier.lora import adapter_salt

        salt = f"{salt or ''}\x00{adapter_salt(lora)}"
    return salt


class KeyChains:
    """Block keys of requests under one fingerprint: a root per salt, and each request's chain
    extended as its tokens grow (`chain_keys`, the engine's own key chain)."""

    def __init__(self, fingerprint: bytes, block_size: int) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self._roots: dict[str | None, BlockKey] = {}

    def root(self, salt: str | None) -> BlockKey:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_key(self.fingerprint, salt)
        return root

    def extend(self, keys: list[BlockKey], tokens: Sequence[int], salt: str | None, num_blocks: int) -> list[BlockKey]:
        """The first `num_blocks` keys of `tokens`' chain; `keys` (the chain so far, extended in
        place) caches them."""
        have = len(keys)
        if have < num_blocks:
            parent = keys[-1] if keys else self.root(salt)
            keys += chain_keys(parent, tokens, self.block_size, start_block=have, num_blocks=num_blocks - have)
        return keys[:num_blocks]
