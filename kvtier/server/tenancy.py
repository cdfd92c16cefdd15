"""Tenants: who a request belongs to, resolved from its API key.

Every request runs as exactly one `Tenant`. Its `cache_salt` goes into the root of every block
key the request makes (see kvtier/kvcache/keys.py), so KV is never shared across tenants. Today
one resolver exists: every request is the default tenant, whose salt is None (KV is shared, as
in the offline API). Per-key tenants, encryption keys and deletion policies plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Tenant:
    name: str
    cache_salt: str | None = None
    """Mixed into every block key of this tenant's requests; None: the shared, unsalted space."""

    def effective_salt(self, request_salt: str | None) -> str | None:
        """The salt a request runs with: the tenant's, narrowed by the request's own
        `cache_salt` (a tenant can split its space further, never join another's)."""
        if self.cache_salt is None:
            return request_salt
        if request_salt is None:
            return self.cache_salt
        return f"{self.cache_salt}\x00{request_salt}"


DEFAULT_TENANT = Tenant("default", None)


class TenantResolver(Protocol):
    def resolve(self, api_key: str | None) -> Tenant:
        """The tenant of a request carrying `api_key` (None: no Authorization header).
        Raises `PermissionError` for a key it refuses (the server answers 401)."""
        ...


class SingleTenantResolver:
    """Every request, whatever its key, is `tenant`."""

    def __init__(self, tenant: Tenant = DEFAULT_TENANT) -> None:
        self.tenant = tenant

    def resolve(self, api_key: str | None) -> Tenant:
        return self.tenant


def api_key_from_header(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()
