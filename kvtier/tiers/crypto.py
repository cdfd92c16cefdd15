"""Per-tenant encryption at rest: AES-256-GCM data keys kept in a key directory.

    keys = KeyStore("/var/lib/kvtier/keys")     # created 0700; each key file 0600
    cipher = keys.cipher("tenant-a")              # creates the tenant's data key on first use
    frame = codec.encode(kv, ..., cipher=cipher)  # payload encrypted, header authenticated
    keys.destroy("tenant-a")                      # key overwritten and removed: every copy of
                                                  # that tenant's KV, anywhere, is unreadable

The codec passes the frame header as associated data, so a payload cannot be moved under
another header. Each encryption draws a fresh 96-bit nonce (stored in front of the ciphertext).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

NONCE_BYTES = 12
KEY_BYTES = 32


class KeyDestroyedError(LookupError):
    """The tenant's data key no longer exists (it was purged)."""


class AesGcmCipher:
    """The codec's Cipher hook over one data key."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if len(key) != KEY_BYTES:
            raise ValueError("AES-256-GCM needs a 32-byte key")
        self._aead = AESGCM(key)

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, bytes(plaintext), bytes(aad))

    def decrypt(self, ciphertext: bytes | memoryview, aad: bytes) -> bytes:
        data = bytes(ciphertext)
        if len(data) < NONCE_BYTES + 16:
            raise ValueError("ciphertext too short")
        return self._aead.decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], bytes(aad))


class KeyStore:
    """Data keys, one file per tenant, readable by the owner only."""

    def __init__(self, directory: str | Path) -> None:
        from kvtier.tiers.disk import make_private_dir

        self.dir = Path(directory)
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        make_private_dir(self.dir, "--kv-key-dir")  # another user's directory is refused
        self._lock = threading.Lock()
        self._ciphers: dict[str, AesGcmCipher] = {}

    def _path(self, tenant: str) -> Path:
        name = hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:32]
        return self.dir / f"{name}.key"

    def has_key(self, tenant: str) -> bool:
        return self._path(tenant).is_file()

    def cipher(self, tenant: str, create: bool = True) -> AesGcmCipher:
        """The tenant's cipher; its key is created (0600, crash-safe) on first use."""
        with self._lock:
            c = self._ciphers.get(tenant)
            if c is not None:
                return c
            path = self._path(tenant)
            if path.is_file():
                key = path.read_bytes()
            elif create:
                key = os.urandom(KEY_BYTES)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, key)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            else:
                raise KeyDestroyedError(f"no data key for tenant {tenant!r}")
            c = self._ciphers[tenant] = AesGcmCipher(key)
            return c

    def forget(self, tenant: str) -> None:
        """Drop the cached cipher (the next use reads the key file again)."""
        with self._lock:
            self._ciphers.pop(tenant, None)

    def destroy_all(self) -> int:
        """Destroy every data key in the directory; returns how many."""
        with self._lock:
            self._ciphers.clear()
        n = 0
        for path in self.dir.glob("*.key"):
            _shred(path)
            n += 1
        return n

    def destroy(self, tenant: str) -> bool:
        """Overwrite and remove the tenant's key. True if a key existed."""
        with self._lock:
            self._ciphers.pop(tenant, None)
            path = self._path(tenant)
            if not path.is_file():
                return False
            _shred(path)
            return True


def _shred(path: Path) -> None:
    """Overwrite a key file with zeros, sync, and remove it."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(b"\x00" * size)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()
