"""A request's tenancy: who it belongs to, as it crosses the engine boundary (issue 30).

One immutable value per request, built once where the tenant is known (the server, from the
API key; `EngineCore.add_request` for the offline API) and carried from there on::

    server       Tenancy.of(tenant.name, tenant.effective_salt(req.cache_salt))
    protocol     AddRequest.tenancy (a msgspec Struct: it encodes as it is)
    engine       the request group and each sequence (kvtier.sched.request.Request.tenancy)
    kvcache      the owner of the blocks the request computes
    tiers        its `owner_id` (purge fences, owner manifests), never hashed again

`owner_id` is the hash under which the tiers store a tenant's blocks (so names never reach the
disk or Redis); kvtier.tiers.owners re-exports it and DEFAULT_OWNER from here, their former home.
A leaf: it imports nothing from kvtier, so the engine, the scheduler, the cache, the tiers and
the server may all use it.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TypeAlias

import msgspec

DEFAULT_OWNER = "_default"
"""The data key of blocks that belong to no named tenant (offline use, a single-tenant server)."""


@functools.lru_cache(maxsize=4096)
def owner_id(owner: str | None) -> str:
    """A tenant's name as stored beside its blocks: hashed, so names never reach the disk."""
    return hashlib.sha256((owner or DEFAULT_OWNER).encode("utf-8")).hexdigest()[:32]


class Tenancy(msgspec.Struct, frozen=True, array_like=True):
    """Who a request belongs to: its tenant's name, the salt of its prefix cache and the
    tenant's owner id, computed once (`Tenancy.of`). Immutable and hashable."""

    tenant: str | None
    """The tenant's name (None: no named tenant). Admin calls (purge, TTL, quota, usage) name it."""
    cache_salt: str | None
    """The effective salt its block keys are rooted in (kvtier.kvcache.keys.root_key): the
    server's tenant salt with the request's own, already combined."""
    owner_id: str
    """owner_id(tenant): the tiers' name of the tenant (fences, manifests, owner sets)."""

    @classmethod
    def of(cls, tenant: str | None = None, cache_salt: str | None = None) -> Tenancy:
        """The tenancy of `tenant`'s requests salted with `cache_salt` (its owner id hashed here)."""
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError("tenant must be a string")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        return cls(tenant, cache_salt, owner_id(tenant))


ANONYMOUS = Tenancy.of()
"""No named tenant, no salt: offline use and a single-tenant server."""


Owner: TypeAlias = "Tenancy | str | None"
"""What the tiers accept as a block's owner: a request's Tenancy (its owner id precomputed), or
a tenant's name (None: no named tenant) from a caller that knows only the name."""


def as_tenancy(owner: Tenancy | str | None) -> Tenancy:
    """`owner` as a Tenancy: itself, or a tenant's name (None: no named tenant) made into one
    (unsalted: the tiers never use the salt). For callers that know only a name."""
    return owner if isinstance(owner, Tenancy) else Tenancy.of(owner)


def tenant_of(owner: Tenancy | str | None) -> str | None:
    """The tenant's name of `owner` (a Tenancy or already a name)."""
    return owner.tenant if isinstance(owner, Tenancy) else owner
