"""Tenants: who a request belongs to, resolved from its API key.

Every request runs as exactly one `Tenant`. Its `cache_salt` goes into the root of every block
key the request makes (see kvtier/kvcache/keys.py), so KV is never shared across tenants. Today
one resolver exists: every request is the default tenant, whose salt is None (KV is shared, as
in the offline API). Per-key tenants, encryption keys and deletion policies plug in here.
`AdminAuth` decides who may call admin endpoints (purges, integrity checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.identity import Tenancy


@dataclass(frozen=True)
class Tenant:
    name: str
    cache_salt: str | None = None
    """Mixed into every block key of this tenant's requests; None: the shared, unsalted space."""
    admin: bool = False
    """May act on other tenants (cache purge, integrity checks)."""
    ttl_s: float | None = None
    """The tenant's KV lives at most this long in any tier (None: until evicted)."""
    host_bytes: int | None = None
    disk_bytes: int | None = None
    """Caps on the tenant's KV in the host and disk tiers (None: no cap of its own)."""

    def effective_salt(self, request_salt: str | None) -> str | None:
        """The salt a request runs with: the tenant's, narrowed by the request's own
        `cache_salt` (a tenant can split its space further, never join another's)."""
        if self.cache_salt is None:
            return request_salt
        if request_salt is None:
            return self.cache_salt
        return f"{self.cache_salt}\x00{request_salt}"

    def tenancy(self, request_salt: str | None) -> Tenancy:
        """What one of this tenant's requests carries across the engine boundary: its name, the
        effective salt (`effective_salt`) and its owner id, made once here (kvtier.identity)."""
        return Tenancy.of(self.name, self.effective_salt(request_salt))


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


def tenant_salt(name: str) -> str:
    """The cache salt of a named tenant (hashed into every block key's root)."""
    return f"tenant:{name}"


def tenant_hash(name: str) -> str:
    """A stable, non-reversible id for logs and metrics."""
    import hashlib

    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:16]


class ApiKeyResolver:
    """API keys from a JSON file mapped to tenants; any other key is refused (401).

        {"keys": {"sk-acme-1": "acme",
                  "sk-ops": {"tenant": "ops", "admin": true}},
         "tenants": {"acme": {"ttl_s": 86400, "host_bytes": 1073741824, "disk_bytes": 10737418240}}}

    Each tenant gets its own cache salt, so the same prompt from two tenants never shares KV
    (no timing side channel); a request's `cache_salt` can only subdivide its tenant's space.
    """

    def __init__(self, keys: dict[str, Tenant]) -> None:
        if not keys:
            raise ValueError("the API key file names no keys")
        self._keys = dict(keys)

    @classmethod
    def from_file(cls, path: str) -> ApiKeyResolver:
        import json

        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"the API key file {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("keys"), dict):
            raise ValueError(f'the API key file {path} needs a \'keys\' object: {{"keys": {{"KEY": "TENANT"}}}}')
        policies = data.get("tenants") or {}
        if not isinstance(policies, dict):
            raise ValueError(f'\'tenants\' in {path} must be an object: {{"NAME": {{"ttl_s": SECONDS}}}}')
        keys: dict[str, Tenant] = {}
        for key, spec in data["keys"].items():
            if isinstance(spec, str):
                spec = {"tenant": spec}
            if not isinstance(spec, dict) or not isinstance(spec.get("tenant"), str) or not spec["tenant"]:
                raise ValueError(f'API key {key[:6]}...: give a tenant name (a string or {{"tenant": NAME}})')
            name = spec["tenant"]
            ttl = (policies.get(name) or {}).get("ttl_s")
            if ttl is not None and (not isinstance(ttl, (int, float)) or ttl <= 0):
                raise ValueError(f"tenant {name!r}: ttl_s must be a positive number of seconds")
            pol = policies.get(name) or {}
            for field_name in ("host_bytes", "disk_bytes"):
                v = pol.get(field_name)
                if v is not None and (not isinstance(v, int) or v <= 0):
                    raise ValueError(f"tenant {name!r}: {field_name} must be a positive integer")
            keys[key] = Tenant(
                name,
                tenant_salt(name),
                admin=bool(spec.get("admin", False)),
                ttl_s=ttl,
                host_bytes=pol.get("host_bytes"),
                disk_bytes=pol.get("disk_bytes"),
            )
        return cls(keys)

    def tenants(self) -> list[Tenant]:
        return list({t.name: t for t in self._keys.values()}.values())

    def resolve(self, api_key: str | None) -> Tenant:
        if api_key is None:
            raise PermissionError("missing API key: send 'Authorization: Bearer KEY'")
        tenant = self._keys.get(api_key)
        if tenant is None:
            raise PermissionError("invalid API key")
        return tenant


AUTH_MODES = ("public", "api_key", "admin")
"""Who may read /metrics and /v1/models: anyone, a valid API key (or the admin key), the admin."""


def read_admin_key(path: str) -> str:
    """The admin key in a file (surrounding whitespace dropped); errors say what to put there."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the admin key file {path}: {e.strerror}") from None
    if len(key) < 16 or any(c.isspace() for c in key):
        raise ValueError(
            f"the admin key file {path} must hold one key of at least 16 characters "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE)"
        )
    return key


class AdminAuth:
    """Who may call admin and destructive endpoints: the bearer of `admin_key`
    (--admin-key-file) or of a key marked admin in the --api-keys file.

    `open_reads`: a server with no credential at all (no --api-keys, no --admin-key-file) lets
    anyone call the read-only admin endpoint (/admin/check_integrity) as before; destructive
    ones are refused in every mode unless an admin credential is shown."""

    def __init__(self, resolver: TenantResolver, admin_key: str | None = None) -> None:
        self.resolver = resolver
        self.admin_key = admin_key
        tenants: list[Tenant] = getattr(resolver, "tenants", list)()
        self.multi_tenant = any(t.cache_salt is not None for t in tenants)
        """Keys map to tenants of their own (--api-keys); False with no keys or with `--api-key
        K1 K2 ...`, whose keys all share the one default tenant."""
        self.shared_tenant = getattr(resolver, "tenant", tenants[0] if tenants else DEFAULT_TENANT).name
        """Without tenants of their own: the one tenant every caller is (what an admin acts on)."""
        self.configured = admin_key is not None or any(t.admin for t in tenants)
        self.open_reads = admin_key is None and isinstance(resolver, SingleTenantResolver)

    def is_admin_key(self, api_key: str | None) -> bool:
        """The standalone admin key (constant-time comparison)."""
        import hmac

        return (
            self.admin_key is not None
            and api_key is not None
            and hmac.compare_digest(api_key.encode(), self.admin_key.encode())
        )

    def is_admin(self, api_key: str | None) -> bool:
        if self.is_admin_key(api_key):
            return True
        if api_key is None:
            return False
        try:
            return self.resolver.resolve(api_key).admin
        except PermissionError:
            return False

    @staticmethod
    def owns(tenant: Tenant) -> bool:
        """Whether a key of `tenant` may purge the tenant's KV without an admin credential: only
        a tenant of its own (a named --api-keys tenant). The shared default tenant (no keys, or
        every `--api-key` key) holds everyone's KV, so emptying it is an admin action."""
        return tenant.cache_salt is not None

    def refusal(self, api_key: str | None) -> tuple[int, str]:
        """(status, message) for a caller that is not an admin."""
        if not self.configured:
            return 403, (
                "this endpoint needs an admin credential and the server has none: start it "
                "with --admin-key-file FILE (or mark a key admin in --api-keys)"
            )
        if api_key is None:
            return 401, "this endpoint needs an admin key: send 'Authorization: Bearer ADMIN_KEY'"
        return 403, "this endpoint needs an admin key"
