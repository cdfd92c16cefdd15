"""Owner ids: how a tenant's name is stored beside its blocks (a hash, so names never reach the
disk or Redis). A leaf: it imports nothing from kvtier, so every tier module may use it.

kvtier.tiers.hierarchy re-exports both names (their former home).
"""

from __future__ import annotations

import functools
import hashlib

DEFAULT_OWNER = "_default"
"""The data key of blocks that belong to no named tenant (offline use, a single-tenant server)."""


@functools.lru_cache(maxsize=4096)
def owner_id(owner: str | None) -> str:
    """A tenant's name as stored beside its blocks: hashed, so names never reach the disk."""
    return hashlib.sha256((owner or DEFAULT_OWNER).encode("utf-8")).hexdigest()[:32]
