"""Purges from outside a running engine (`kvtier cache purge`, the vLLM connector's tenants):
find every model configuration that stores anything of a tenant on disk or in Redis, open a
TierHierarchy over each and purge the tenant there, destroy its data key, and post a purge
request that running processes act on.

Above the hierarchy. The primitives a purge needs below it (the fence, the ledger, the requests
channel) live in kvtier.tiers.fence; they are re-exported here, their former home.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtier.tiers.crypto import KeyStore
from kvtier.tiers.fence import (
    ALL,
    PURGE_REQUESTS_DIR,
    PURGE_REQUESTS_HASH,
    OwnerFence,
    PurgeLedger,
    PurgeRequests,
    Stamp,
)
from kvtier.tiers.hierarchy import TierConfig, TierHierarchy
from kvtier.tiers.owners import DEFAULT_OWNER, owner_id

__all__ = [
    "ALL",
    "PURGE_REQUESTS_DIR",
    "PURGE_REQUESTS_HASH",
    "OwnerFence",
    "PurgeLedger",
    "PurgeRequests",
    "Stamp",
    "purge_stored",
]


def _stored_fingerprints(disk_cache_dir: str | None, remote_cache_url: str | None, oid: str) -> set[bytes]:
    """Model configurations (fingerprints) that hold anything of `oid` on disk or in Redis."""
    found: set[bytes] = set()
    if disk_cache_dir and Path(disk_cache_dir).is_dir():
        for entry in os.scandir(disk_cache_dir):
            if entry.is_dir() and len(entry.name) == 32:
                try:
                    found.add(bytes.fromhex(entry.name))
                except ValueError:
                    continue
    if remote_cache_url:
        from kvtier.tiers.remote import RemoteTier  # redis: only when a URL is given

        found |= RemoteTier.owner_fingerprints(remote_cache_url, oid)
    return found


def purge_stored(
    tenant: str | None,
    *,
    disk_cache_dir: str | None = None,
    remote_cache_url: str | None = None,
    key_dir: str | None = None,
    master_key_file: str | None = None,
    notify: bool = True,
) -> dict[str, Any]:
    """Delete every stored block of `tenant` (a vLLM `cache_salt`; None: requests without one)
    from the disk tier and Redis, for every model configuration found there, destroy its data
    key, and post a purge request that running processes act on (their in-memory copies).
    Returns the counts per fingerprint and where the request was posted."""
    oid = owner_id(tenant)
    out: dict[str, Any] = {"owner_id": oid, "fingerprints": {}}
    for fp in sorted(_stored_fingerprints(disk_cache_dir, remote_cache_url, oid)):
        config = TierConfig(
            disk_cache_dir=disk_cache_dir,
            disk_cache_bytes=1 << 62 if disk_cache_dir else None,
            remote_cache_url=remote_cache_url,
            key_dir=key_dir,
            master_key_file=master_key_file,
        )
        tiers = TierHierarchy(config, fingerprint=fp, block_bytes=1, block_size=1)
        try:
            out["fingerprints"][fp.hex()] = tiers.tenants.purge_owner(tenant)
        finally:
            tiers.close()
    if key_dir and not out["fingerprints"]:
        out["key_destroyed"] = int(KeyStore(key_dir).destroy(tenant or DEFAULT_OWNER))
    if notify:
        out["requested_at"] = PurgeRequests(disk_cache_dir or key_dir, remote_cache_url).post(oid)
    return out
