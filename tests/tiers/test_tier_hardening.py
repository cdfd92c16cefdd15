"""Tier hardening: a --kv-key-dir of another user is refused, the disk tier counts what the file
system charges, unreadable owner-manifest entries are logged and counted, a master key the
fleet does not use is refused (its purge deletes nothing), a tenant purge in Redis leaves no
block that raced it, Redis usage forgets what the TTL removed, and the offline API takes a
master key file. Real redis-server processes (conftest.redis_server), real directories."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from kvtier.tiers.disk import DiskTier

from .conftest import FINGERPRINT, make_keys


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_a_loose_key_dir_of_another_user_is_refused_not_chmodded(tmp_path: Path) -> None:
    from kvtier.tiers.crypto import KeyStore

    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    d = tmp_path / "keys"
    d.mkdir()
    os.chmod(d, 0o755)
    os.chown(d, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match=r"owned by uid 65534 .*--kv-key-dir"):
        KeyStore(d)
    assert mode(d) == 0o755  # not changed behind its owner's back


def test_a_key_dir_of_ours_is_made_private(tmp_path: Path) -> None:
    from kvtier.tiers.crypto import KeyStore

    d = tmp_path / "keys"
    d.mkdir()
    os.chmod(d, 0o777)
    store = KeyStore(d)
    assert mode(d) == 0o700
    assert store.cipher("acme") is not None
    fresh = tmp_path / "nested" / "keys"
    KeyStore(fresh)
    assert mode(fresh) == 0o700


def test_disk_usage_and_cap_count_allocated_bytes(tmp_path: Path) -> None:
    payload = b"k" * 5000  # apparent 5000 bytes; the file system charges whole blocks
    probe = DiskTier(tmp_path / "probe", 1 << 20, fingerprint=FINGERPRINT)
    (k0,) = make_keys(1, salt=9)
    assert probe.put(k0, payload)
    (path,) = [p for p in probe.dir.glob("*/*.kv")]
    charged = os.stat(path).st_blocks * 512
    assert charged >= len(payload) and probe.usage_bytes == charged
    keys = make_keys(3)
    tier = DiskTier(tmp_path / "capped", 2 * charged, fingerprint=FINGERPRINT)
    for k in keys:
        assert tier.put(k, payload)
    on_disk = sum(p.stat().st_blocks * 512 for p in tier.dir.glob("*/*.kv"))
    assert tier.usage_bytes == on_disk <= tier.capacity_bytes  # apparent sizes would fit 3
    assert len(tier) == 2 and tier.get(keys[0]) is None
    again = DiskTier(tmp_path / "capped", 2 * charged, fingerprint=FINGERPRINT)  # a warm start agrees
    assert again.usage_bytes == on_disk


def test_unreadable_owner_manifest_entries_are_logged_once_and_counted(tmp_path: Path, caplog) -> None:
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    keys = make_keys(2)
    for k in keys:
        assert tier.put(k, b"kv")
    tier.record_owner("acme", keys)
    with open(tier.dir / "owners" / "acme.keys", "ab") as f:
        f.write(b"zz-not-hex 1.0\n\xff\xfe garbage\nabcd 1.0\n")
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        assert sorted(tier.owner_keys("acme")) == sorted(keys)  # the good entries still count
        assert sorted(tier.owner_keys("acme")) == sorted(keys)
    warnings = [r for r in caplog.records if "owner manifest" in r.getMessage()]
    assert len(warnings) == 2  # once per cause: unparsable lines, a key of the wrong length
    assert tier.manifest_errors == {"unparsable_line": 4, "bad_key_length": 2}
    assert tier.stats.errors["owner_manifest_unparsable_line"] == 4


# -- Redis: key domain, atomic purge, TTL usage ---------------------------------------------------


def remote(server):
    from kvtier.tiers.remote import RemoteTier

    return RemoteTier(server.url, fingerprint=FINGERPRINT)


def test_a_master_key_the_fleet_does_not_use_is_refused_and_deletes_nothing(redis_server) -> None:
    from kvtier.tiers.keyring import FleetKeyring, KeyDomainError

    mine, theirs = os.urandom(32), os.urandom(32)
    a, b = remote(redis_server), remote(redis_server)
    try:
        ring = FleetKeyring(mine, a)
        ring.cipher("acme")
        client = redis_server.client()
        (record,) = [n for n in client.scan_iter(match="kvtier:*:keycheck")]
        assert mine not in client.get(record)  # a MAC of a label, never the key
        names = sorted(client.scan_iter(match="*"))
        with pytest.raises(KeyDomainError, match="give every instance the same file"):
            FleetKeyring(theirs, b)
        assert sorted(client.scan_iter(match="*")) == names
        FleetKeyring(mine, b).cipher("acme")  # the same key passes
    finally:
        a.close()
        b.close()


def test_the_offline_api_takes_a_master_key_file_and_refuses_a_foreign_one(redis_server, tmp_path: Path) -> None:
    from kvtier import LLM, SamplingParams
    from kvtier.model.builder import build_random_llama
    from kvtier.tiers.keyring import KeyDomainError

    build_random_llama(
        tmp_path / "m",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=64,
        dtype="float32",
    )
    master, other = tmp_path / "master.key", tmp_path / "other.key"
    master.write_bytes(os.urandom(32))
    other.write_bytes(os.urandom(32))
    kw = dict(
        dtype="float32", num_device_blocks=32, block_size=4, skip_tokenizer_init=True, remote_cache_url=redis_server.url
    )
    with LLM(str(tmp_path / "m"), kv_master_key_file=str(master), kv_key_check_interval_s=0.5, **kw) as llm:
        fleet = llm.engine.tiers.sealing.fleet_keys
        assert fleet is not None and fleet.check_interval_s == 0.5
        llm.generate([{"prompt_token_ids": list(range(1, 13))}], SamplingParams(max_tokens=1))
        llm.engine.check_integrity()
    with pytest.raises(KeyDomainError):
        LLM(str(tmp_path / "m"), kv_master_key_file=str(other), **kw)


def test_tenant_purge_in_redis_takes_blocks_stored_while_it_runs(redis_server) -> None:
    tier = remote(redis_server)
    try:
        keys = make_keys(700)  # more than one SPOP batch
        for k in keys:
            assert tier.put(k, b"kv")
        tier.record_owner("acme", keys)
        late = make_keys(3, salt=1)
        real_unlink = tier.unlink
        raced: list[bool] = []

        def unlink_racing_a_store(batch: list[bytes]) -> int:
            if not raced:
                raced.append(True)
                for k in late:  # a store of the tenant lands between two rounds of the purge
                    tier.put(k, b"kv")
                tier.record_owner("acme", late)
            return real_unlink(batch)

        tier.unlink = unlink_racing_a_store  # type: ignore[method-assign]
        assert tier.drain_owner("acme") == len(keys) + len(late)
        assert tier.contains_count(keys + late) == 0
        assert not redis_server.client().exists(b"kvtier:" + FINGERPRINT.hex().encode() + b":owner:acme")
    finally:
        tier.close()


def test_redis_usage_forgets_entries_the_ttl_removed(redis_server) -> None:
    tier = remote(redis_server)
    client = redis_server.client()
    try:
        keys = make_keys(4)
        for k in keys:
            assert tier.put(k, b"kv")
        tier.record_owner("acme", keys)
        assert tier.contains_count(keys, "acme") == 4
        for k in keys[:3]:
            client.pexpire(tier._name(k), 1)  # what a TTL does
        for _ in range(1000):  # bounded: until the server has dropped them
            if not any(client.exists(tier._name(k)) for k in keys[:3]):
                break
            time.sleep(0.001)
        assert tier.contains_count(tier.owner_keys("acme"), "acme") == 1
        assert tier.owner_keys("acme") == [keys[3]]  # the owner set forgets them too
    finally:
        tier.close()
