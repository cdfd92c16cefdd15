"""Owner ids: how a tenant's name is stored beside its blocks (a hash, so names never reach the
disk or Redis). Defined in the leaf kvtier.identity (with the Tenancy a request carries, its
owner id computed once); re-exported here, and by kvtier.tiers.hierarchy (their former homes).
"""

from __future__ import annotations

from kvtier.identity import DEFAULT_OWNER, owner_id

__all__ = ["DEFAULT_OWNER", "owner_id"]
