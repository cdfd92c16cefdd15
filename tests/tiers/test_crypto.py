"""Encryption at rest: per-tenant data keys, owner-only files, destroyed keys make every copy
unreadable."""

from __future__ import annotations

import stat

import pytest
import torch

pytest.importorskip("cryptography")

from kvtier.tiers.codec import CodecError, decode, encode
from kvtier.tiers.crypto import KeyDestroyedError, KeyStore

FP = b"f" * 16
KEY = b"k" * 16


def kv() -> torch.Tensor:
    return torch.randn(2, 2, 2, 16, 8).to(torch.bfloat16)


def test_round_trip_and_payload_is_not_plaintext(tmp_path):
    store = KeyStore(tmp_path / "keys")
    t = kv()
    plain = encode(t, fingerprint=FP, key=KEY)
    frame = encode(t, fingerprint=FP, key=KEY, cipher=store.cipher("a"))
    raw = t.view(torch.int16).numpy().tobytes()
    assert raw in plain and raw not in frame
    assert torch.equal(decode(frame, fingerprint=FP, key=KEY, cipher=store.cipher("a")), t)


def test_key_files_are_owner_only(tmp_path):
    store = KeyStore(tmp_path / "keys")
    store.cipher("a")
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    files = list((tmp_path / "keys").iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    # a second store on the same directory (a restarted process) reads the same key
    frame = encode(kv(), fingerprint=FP, key=KEY, cipher=store.cipher("a"))
    decode(frame, fingerprint=FP, key=KEY, cipher=KeyStore(tmp_path / "keys").cipher("a"))


def test_other_tenant_cannot_decrypt(tmp_path):
    store = KeyStore(tmp_path / "keys")
    frame = encode(kv(), fingerprint=FP, key=KEY, cipher=store.cipher("a"))
    with pytest.raises(CodecError):
        decode(frame, fingerprint=FP, key=KEY, cipher=store.cipher("b"))


def test_destroyed_key_makes_old_copies_unreadable(tmp_path):
    store = KeyStore(tmp_path / "keys")
    frame = encode(kv(), fingerprint=FP, key=KEY, cipher=store.cipher("a"))
    assert store.destroy("a") and not store.has_key("a")
    assert list((tmp_path / "keys").iterdir()) == []
    with pytest.raises(KeyDestroyedError):
        store.cipher("a", create=False)
    # a new key for the same tenant does not open the old copy
    with pytest.raises(CodecError):
        decode(frame, fingerprint=FP, key=KEY, cipher=KeyStore(tmp_path / "keys").cipher("a"))
    assert store.destroy("a") and store.destroy("a") is False  # the new key, then nothing
