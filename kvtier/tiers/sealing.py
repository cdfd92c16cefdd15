"""Sealing: the frames the disk and remote tiers store, encrypted with each tenant's data key.

    TierHierarchy._encode ──> Sealing.seal(kv, key, owner) ──> codec.encode(..., cipher)
                                   │ cipher(owner)
                                   v
                              keys: KeyStore (crypto.py, --kv-key-dir)
                                  | FleetKeyring (keyring.py, --kv-master-key-file) ──> on_revoked
                                   ^                                                       │
    TierHierarchy._decode ──> Sealing.unseal(tier, frame, key, owner)   revoked_owners <───┘
                                   │ codec.decode; a frame that does not decode: with fleet keys,
                                   v once more with the owner's current key, else tier.report_corrupt

No keys (neither flag): frames are not encrypted (`cipher` is None). The tenant administration
(tenants.TenantAdmin) forgets and destroys keys through `keys` / `fleet_keys` when it purges.
"""

from __future__ import annotations

import threading
from typing import Any

from kvtier.tiers.crypto import KeyDestroyedError, KeyStore
from kvtier.tiers.keyring import FleetKeyring, KeyringError, read_master_key
from kvtier.tiers.owners import DEFAULT_OWNER


class Sealing:
    """The data keys of one TierHierarchy and what it does with them: seal and unseal frames.

    Holds: the keys (`keys`: a KeyStore, a FleetKeyring or None), the model configuration's
    fingerprint and compression (each frame carries them), and the tenants whose fleet key
    another instance destroyed or replaced (`revoked_owners`, taken by the engine).

    Thread-safety: `seal`, `unseal`, `cipher` and `refresh_key` run on any thread (the I/O
    workers, the admin worker); the keys lock themselves. `_lock` guards `revoked_owners` only
    (a leaf: nothing else is locked while it is held). `use_key_dir` / `use_fleet_keys` run
    before any request does.

    Failures: `cipher` raises KeyDestroyedError / KeyringError when there is no key to be had
    (the caller skips the store, or misses); `unseal` never raises for a frame: one that does
    not decode is reported to its tier as corrupt and read as a miss."""

    def __init__(self, fingerprint: bytes, compression: str | None = None) -> None:
        self.fingerprint = fingerprint
        self.compression = compression
        self.keys: FleetKeyring | KeyStore | None = None
        """The data keys (None: frames are not encrypted)."""
        self._lock = threading.Lock()
        self.revoked_owners: set[str | None] = set()
        """Tenants whose fleet data key another instance destroyed or replaced: the engine
        purges its own copies of them (AsyncEngine) and clears the entry (`take_revoked`)."""

    # ------------------------------------------------------------------ the keys
    def use_key_dir(self, key_dir: str) -> None:
        """Per-instance data keys kept in `key_dir` (crypto.KeyStore)."""
        self.keys = KeyStore(key_dir)

    def use_fleet_keys(self, master_key_file: str, remote: Any, check_interval_s: float = 1.0) -> None:
        """Fleet data keys (keyring.FleetKeyring): wrapped by the master key in
        `master_key_file` and kept in the `remote` tier."""
        self.keys = FleetKeyring(
            read_master_key(master_key_file),
            remote,
            check_interval_s=check_interval_s,
            on_revoked=self._on_key_revoked,
        )

    @property
    def fleet_keys(self) -> FleetKeyring | None:
        """The data keys when they are fleet keys (kvtier.tiers.keyring), else None."""
        if self.keys is None:
            return None
        return self.keys if isinstance(self.keys, FleetKeyring) else None

    def cipher(self, owner: str | None):
        """The owner's cipher (None: no encryption). Raises KeyDestroyedError / KeyringError
        when there is none to be had: the caller skips the block (a store) or misses (a load)."""
        return None if self.keys is None else self.keys.cipher(owner or DEFAULT_OWNER)

    def _on_key_revoked(self, tenant: str) -> None:
        """The fleet keyring saw `tenant`'s key destroyed or replaced by another instance."""
        with self._lock:
            self.revoked_owners.add(None if tenant == DEFAULT_OWNER else tenant)

    def refresh_key(self, owner: str | None) -> None:
        """Fleet keys: re-read `owner`'s wrapped key if the cached one is older than the check
        interval (any thread; a revocation lands in `revoked_owners`). No-op otherwise."""
        fleet = self.fleet_keys
        if fleet is not None:
            fleet.refresh(owner or DEFAULT_OWNER)

    def take_revoked(self) -> list[str | None]:
        """The revoked tenants, cleared."""
        with self._lock:
            out, self.revoked_owners = list(self.revoked_owners), set()
        return out

    # ------------------------------------------------------------------ frames
    def seal(self, kv: Any, key: bytes, owner: str | None) -> bytes:
        """The frame a disk or remote tier stores for one block (raises as `cipher` does)."""
        from kvtier.tiers.codec import encode  # torch: only when frames are made

        return encode(
            kv, fingerprint=self.fingerprint, key=key, compression=self.compression, cipher=self.cipher(owner)
        )

    def unseal(self, tier: Any, data: bytes, key: bytes, owner: str | None) -> Any | None:
        """A frame's KV, or None (reported to `tier` as corrupt) when it does not decode."""
        from kvtier.tiers.codec import CodecError, decode  # torch: only when frames are made

        try:
            cipher = self.cipher(owner)
        except (KeyDestroyedError, KeyringError):
            return None  # no key to be had now: a miss, the entry stays
        try:
            return decode(data, fingerprint=self.fingerprint, key=key, cipher=cipher)
        except CodecError:
            fresh = self._recheck_key(owner, cipher)
            if fresh is not None:  # another instance made the entry with the fleet's newer key
                try:
                    return decode(data, fingerprint=self.fingerprint, key=key, cipher=fresh)
                except CodecError:
                    pass
            tier.report_corrupt(key)
            return None

    def _recheck_key(self, owner: str | None, used: Any) -> Any | None:
        """Fleet keys: the owner's current cipher if it differs from `used`, else None."""
        fleet = self.fleet_keys
        if used is None or fleet is None:
            return None
        try:
            fresh = fleet.check(owner or DEFAULT_OWNER)
        except Exception:  # noqa: BLE001 - Redis unreachable, a wrong master key: treat as corrupt
            return None
        return fresh if fresh is not None and fresh.key_id != used.key_id else None
