"""Fleet key management: envelope encryption with the wrapped data keys kept in the shared Redis.

    every instance: --kv-master-key-file FILE (the same 32 random bytes), --remote-cache-url URL

    Redis  "<prefix>:<fingerprint>:datakey:<owner id>" -> "KVK1" | key id (16) | nonce (12) |
                                                          AES-256-GCM(master, data key)
    frame payload (codec's cipher hook)               -> key id (16) | nonce (12) | ciphertext

The first instance that needs a tenant's data key creates one and stores it wrapped with
SET NX, so whichever instance wins, every instance unwraps the same key and reads every other
instance's entries. A purge deletes the wrapped key: every copy of the tenant's KV, in Redis
and on every instance's disk, is then unreadable to all of them.

An instance caches an unwrapped key and re-reads the wrapped one at most every
`check_interval_s` (and on every admission of the tenant's requests, see AsyncEngine.add):
that is the bound on how long it can keep using a key another instance destroyed. When the
wrapped key is gone or has another key id, the old key is forgotten and `on_revoked(tenant)`
is called, so the instance purges its own copies (device, host, disk) too. While Redis cannot
be reached a cached key stays in use (nothing of the tenant in Redis is readable meanwhile).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag

from kvtier.tiers.crypto import KEY_BYTES, NONCE_BYTES, KeyDestroyedError
from kvtier.tiers.errors import TierError
from kvtier.tiers.owners import owner_id

MAGIC = b"KVK1"
KEY_ID_BYTES = 16
DATA_KEY_RECORD = b"datakey:"
"""A wrapped data key, "<prefix>:<fingerprint>:datakey:<owner id>" (RemoteTier.record_name)."""
KEY_CHECK_NAME = b"keycheck"
KEY_CHECK_LABEL = b"kvtier fleet master key check v1\x00"
"""The key-check record, "<prefix>:<fingerprint>:keycheck" -> HMAC-SHA256(master, label | prefix)."""

logger = logging.getLogger("kvtier.tiers")


class KeyringError(RuntimeError):
    """The fleet keyring cannot give a key (a wrong master key, Redis unreachable)."""


class KeyDomainError(KeyringError, ValueError):
    """This master key is not the one the fleet sharing the Redis uses (the key-check record
    differs): a configuration error, so the CLI says it in one line and exits non-zero."""


def read_master_key(path: str | os.PathLike) -> bytes:
    """A master key file: 32 raw bytes or 64 hex digits. Errors say how to make one."""
    hint = "make one with: head -c 32 /dev/urandom > FILE (give every instance the same file)"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the master key file {path}: {e.strerror}; {hint}") from None
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"the master key file {path} must hold 32 bytes (or 64 hex digits); {hint}")
    return key


class FleetCipher:
    """The codec's cipher hook over one data key; frames name the key id they were made with."""

    def __init__(self, key_id: bytes, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.key_id = key_id
        self._aead = AESGCM(key)

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return self.key_id + nonce + self._aead.encrypt(nonce, bytes(plaintext), bytes(aad))

    def decrypt(self, ciphertext: bytes | memoryview, aad: bytes) -> bytes:
        data = bytes(ciphertext)
        if data[:KEY_ID_BYTES] != self.key_id:
            raise ValueError("made with another data key (destroyed or replaced)")
        body = data[KEY_ID_BYTES:]
        return self._aead.decrypt(body[:NONCE_BYTES], body[NONCE_BYTES:], bytes(aad))


class FleetKeyring:
    """Per-tenant data keys wrapped by `master_key`, stored in `remote` (a RemoteTier).

    Same interface as crypto.KeyStore (`cipher`, `destroy`, `destroy_all`, `has_key`) plus
    `check`. Every Redis operation goes through the tier's gate (`Tier.call`)."""

    def __init__(
        self,
        master_key: bytes,
        remote: Any,
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_revoked: Callable[[str], None] | None = None,
    ) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if len(master_key) != KEY_BYTES:
            raise ValueError("the master key must be 32 bytes")
        self._master = AESGCM(master_key)
        self.remote = remote
        self.check_interval_s = check_interval_s
        self._clock = clock
        self.on_revoked = on_revoked
        self._lock = threading.Lock()
        self._cached: dict[str, tuple[FleetCipher, float]] = {}  # tenant -> (cipher, checked at)
        import hmac

        self._check_mac = hmac.new(master_key, KEY_CHECK_LABEL + remote.name_prefix, "sha256").digest()
        self._domain_checked = False
        try:
            self.verify_domain()  # a different master key than the fleet's: refused at start
        except TierError as e:
            logger.warning(
                "cannot reach Redis to check --kv-master-key-file against the fleet's (%s); "
                "the shared tier's keys stay unused until the check passes",
                e,
            )

    def verify_domain(self, again: bool = False) -> None:
        """Prove this master key is the fleet's: the key-check record in Redis (an HMAC of a
        fixed label under the master key, never the key) is written on first start and compared
        after. Raises KeyringError on a mismatch (another master key owns this Redis), TierError
        when Redis cannot be asked. Every key use and every purge of Redis entries checks first.
        `again`: check (and rewrite) even if an earlier check passed, after a clear of Redis."""
        if self._domain_checked and not again:
            return
        name = self.remote.record_name(KEY_CHECK_NAME)
        mac = self._check_mac

        def op() -> Any:
            client = self.remote.client()
            client.set(name, mac, nx=True)
            return client.get(name)

        import hmac

        theirs = self.remote.call("keyring_check", op)
        if theirs is None or not hmac.compare_digest(bytes(theirs), mac):
            raise KeyDomainError(
                "--kv-master-key-file differs from the master key of the other instances sharing this "
                "Redis (its key-check record does not match): give every instance the same file"
            )
        self._domain_checked = True

    def _name(self, tenant: str) -> bytes:
        return self._name_oid(owner_id(tenant))

    def _name_oid(self, oid: str) -> bytes:
        return self.remote.record_name(DATA_KEY_RECORD + oid.encode())

    def _wrap(self, name: bytes, key_id: bytes, key: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + key_id + nonce + self._master.encrypt(nonce, key, name + key_id)

    def _unwrap(self, name: bytes, blob: bytes) -> FleetCipher:
        if blob[:4] != MAGIC:
            raise KeyringError(f"{name.decode()} in Redis is not a kvtier wrapped key")
        key_id = blob[4 : 4 + KEY_ID_BYTES]
        body = blob[4 + KEY_ID_BYTES :]
        try:
            key = self._master.decrypt(body[:NONCE_BYTES], body[NONCE_BYTES:], name + key_id)
        except (InvalidTag, ValueError):
            raise KeyringError(
                f"the data key {name.decode()} in Redis does not open with this master key: "
                "give every instance the same --kv-master-key-file"
            ) from None
        return FleetCipher(key_id, key)

    def _get(self, name: bytes) -> bytes | None:
        return self.remote.call("keyring_get", lambda: self.remote.client().get(name))

    def check(self, tenant: str) -> FleetCipher | None:
        """Re-read the tenant's wrapped key now; its cipher, or None when there is none. A
        cached key that is gone or replaced is forgotten and reported to `on_revoked`."""
        self.verify_domain()
        name = self._name(tenant)
        blob = self._get(name)  # TierError when Redis cannot be asked
        fresh = None if blob is None else self._unwrap(name, blob)
        with self._lock:
            old = self._cached.pop(tenant, None)
            if fresh is not None:
                self._cached[tenant] = (fresh, self._clock())
        if old is not None and (fresh is None or fresh.key_id != old[0].key_id) and self.on_revoked:
            self.on_revoked(tenant)
        return fresh

    def cipher(self, tenant: str, create: bool = True) -> FleetCipher:
        """The tenant's cipher (cached for `check_interval_s`); created and stored with SET NX
        when the fleet has none. Raises KeyDestroyedError (none and not `create`) or
        KeyringError (Redis unreachable and nothing cached)."""
        with self._lock:
            hit = self._cached.get(tenant)
        if hit is not None and self._clock() - hit[1] < self.check_interval_s:
            return hit[0]
        try:
            c = self.check(tenant)
            if c is not None:
                return c
            if not create:
                raise KeyDestroyedError(f"no data key for tenant {tenant!r}")
            name = self._name(tenant)
            key_id, key = os.urandom(KEY_ID_BYTES), os.urandom(KEY_BYTES)
            blob = self._wrap(name, key_id, key)
            if not self.remote.call("keyring_set", lambda: self.remote.client().set(name, blob, nx=True)):
                theirs = self._get(name)  # another instance won the race: use its key
                if theirs is None:
                    raise KeyringError("the tenant's data key was destroyed while it was being created")
                blob = theirs
            c = self._unwrap(name, blob)
        except TierError as e:
            if hit is not None:
                return hit[0]  # Redis unreachable: keep the cached key (see the module doc)
            raise KeyringError(f"cannot reach the remote tier for tenant {tenant!r}'s data key: {e}") from None
        with self._lock:
            self._cached[tenant] = (c, self._clock())
        return c

    def refresh(self, tenant: str) -> None:
        """Re-read a cached key older than `check_interval_s` (a revocation is reported to
        `on_revoked`); nothing when none is cached or Redis cannot be asked."""
        with self._lock:
            hit = self._cached.get(tenant)
        if hit is None or self._clock() - hit[1] < self.check_interval_s:
            return
        try:
            self.check(tenant)
        except (TierError, KeyringError):
            pass

    def refresh_all(self) -> None:
        """`refresh` every cached key (the periodic key check, with or without requests): a
        key another instance destroyed is reported to `on_revoked` within `check_interval_s`."""
        with self._lock:
            tenants = list(self._cached)
        for tenant in tenants:
            self.refresh(tenant)

    def has_key(self, tenant: str) -> bool:
        return self._get(self._name(tenant)) is not None

    def forget(self, tenant: str) -> None:
        """Drop the cached key (this process stops using it; the fleet's copy stays)."""
        with self._lock:
            self._cached.pop(tenant, None)

    def destroy(self, tenant: str) -> bool:
        """Delete the tenant's wrapped key for the whole fleet. True if one existed. Raises
        TierError when Redis cannot be reached (the caller records the purge as pending)."""
        return self.destroy_oid(owner_id(tenant))

    def destroy_oid(self, oid: str) -> bool:
        """`destroy` by owner id (a pending purge knows only the id). Raises TierError."""
        with self._lock:
            for tenant in [t for t in self._cached if owner_id(t) == oid]:
                del self._cached[tenant]
        self.verify_domain()  # never delete what another master key's fleet owns
        name = self._name_oid(oid)
        return bool(self.remote.call("keyring_destroy", lambda: self.remote.client().unlink(name)))

    def destroy_all(self) -> int:
        """Delete every wrapped key of this model configuration. Raises TierError."""
        self.verify_domain()
        with self._lock:
            self._cached.clear()
        pattern = self.remote.match(DATA_KEY_RECORD + b"*")

        def op() -> int:
            client = self.remote.client()
            names = list(client.scan_iter(match=pattern, count=512))
            return sum(client.unlink(n) for n in names)

        return int(self.remote.call("keyring_destroy", op))
