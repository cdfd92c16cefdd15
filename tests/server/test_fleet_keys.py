"""Two servers with their own disks and no shared key directory, one Redis, one master key
(--kv-master-key-file): each reads the other's entries (no corrupt entries, no overwrites);
a purge on one destroys the tenant's single wrapped key, and the other notices on its next
request for that tenant (--kv-key-check-interval-s 0) and drops its own copies."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

pytest.importorskip("cryptography")
redis = pytest.importorskip("redis")
# 8-14 s a test a mode (two servers and Redis each): the default mode only (conftest.py); the
# purge of an instance's own copies runs in both modes in test_purge*.py
pytestmark = pytest.mark.engine_modes("process")

PROMPT = "A fleet-wide tenant document, served by whichever instance the balancer picks. " * 2


def call(s, method: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{s.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)


def cached(s, key: str = "sk-a", prompt: str = PROMPT) -> int:
    r = call(
        s, "POST", "/v1/completions", key, json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def acme_entries(r) -> dict[bytes, bytes]:
    return {k: r.get(k) for k in r.scan_iter(match="kvtier:*") if b":owner:" not in k and b":datakey:" not in k}


def test_two_instances_share_one_wrapped_key_and_a_purge_reaches_both(serve, tmp_path, redis_url):
    from kvtier.tiers.codec import CodecError, decode
    from kvtier.tiers.keyring import FleetKeyring
    from kvtier.tiers.remote import RemoteTier

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    master = tmp_path / "master.key"
    master.write_bytes(os.urandom(32))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "acme", "sk-admin": {"tenant": "ops", "admin": True}}}))

    def instance(name: str):
        return serve(
            "--api-keys",
            str(keys),
            "--disk-cache-dir",
            str(tmp_path / name),
            "--remote-cache-url",
            redis_url,
            "--kv-master-key-file",
            str(master),
            "--kv-key-check-interval-s",
            "0",
            "--restore-policy",
            "always",
        )

    a, b = instance("a"), instance("b")
    assert cached(a) == 0
    assert call(a, "GET", "/v1/cache", "sk-a").json()["tiers"]["remote"]["blocks"] > 0  # stores landed
    before = acme_entries(r)
    assert before and len(list(r.scan_iter(match="kvtier:*:datakey:*"))) == 1

    # b has never seen the prompt: its hit comes from a's Redis entries, which it can read
    assert cached(b) > 0
    assert cached(b, prompt=PROMPT + "and b's own continuation of it") > 0  # new blocks on b's disk
    assert call(b, "GET", "/v1/cache", "sk-a").json()["tiers"]["disk"]["blocks"] > 0
    after = acme_entries(r)
    assert all(after.get(k) == v for k, v in before.items())  # nothing deleted or overwritten
    assert len(list(r.scan_iter(match="kvtier:*:datakey:*"))) == 1
    b_disk = next((tmp_path / "b").rglob("*.kv"))
    stolen, fp = b_disk.read_bytes(), bytes.fromhex(b_disk.parent.parent.name)

    # a purges acme: the one wrapped key and every Redis entry go, for the whole fleet
    res = call(a, "DELETE", "/v1/cache", "sk-a")
    assert res.status_code == 200 and res.json()["data_key_destroyed"] is True, res.text
    assert [k for k in r.scan_iter(match="kvtier:*") if not k.endswith(b":keycheck")] == []

    # b notices on acme's next request: its device, host and disk copies are dropped
    assert cached(b) == 0
    assert not b_disk.exists() or b_disk.read_bytes() != stolen
    # the frame b had on disk does not open with the fleet's key now (a new one)
    remote = RemoteTier(redis_url, fingerprint=fp)
    try:
        cipher = FleetKeyring(master.read_bytes(), remote).cipher("acme")
        with pytest.raises(CodecError):
            decode(stolen, fingerprint=fp, key=bytes.fromhex(b_disk.stem), cipher=cipher)
    finally:
        remote.close()
    for s in (a, b):
        ok = call(s, "POST", "/admin/check_integrity", "sk-admin")
        assert ok.status_code == 200 and ok.json()["ok"] is True and ok.json()["num_unfinished"] == 0


def fleet_flags(keys, master, disk, redis_url: str, interval: str = "0") -> list[str]:
    return [
        "--api-keys",
        str(keys),
        "--disk-cache-dir",
        str(disk),
        "--remote-cache-url",
        redis_url,
        "--kv-master-key-file",
        str(master),
        "--kv-key-check-interval-s",
        interval,
        "--restore-policy",
        "always",
    ]


def test_an_instance_with_another_master_key_refuses_to_start_and_purges_nothing(serve, tmp_path, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    master, other = tmp_path / "master.key", tmp_path / "other.key"
    master.write_bytes(os.urandom(32))
    other.write_bytes(os.urandom(32))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "acme", "sk-admin": {"tenant": "ops", "admin": True}}}))
    a = serve(*fleet_flags(keys, master, tmp_path / "a", redis_url))
    cached(a)
    assert call(a, "GET", "/v1/cache", "sk-a").json()["tiers"]["remote"]["blocks"] > 0  # stores landed
    before = acme_entries(r)
    assert len(before) > 1 and [k for k in r.scan_iter(match="kvtier:*:keycheck")]
    assert master.read_bytes() not in b"".join(v for v in before.values() if v)  # the record is a MAC
    with pytest.raises(RuntimeError, match=r"exited with [1-9].*") as refused:
        serve(*fleet_flags(keys, other, tmp_path / "b", redis_url))
    log = str(refused.value)
    assert "--kv-master-key-file differs from the master key of the other instances" in log
    assert acme_entries(r) == before  # nothing of the fleet's was deleted or overwritten
    assert cached(a) > 0  # and the fleet still reads it
    ok = call(a, "POST", "/admin/check_integrity", "sk-admin")
    assert ok.status_code == 200 and ok.json()["ok"] is True


def test_a_purge_elsewhere_empties_an_idle_instance_within_the_check_interval(serve, tmp_path, redis_url):
    """b gets no request of acme after a's purge: its periodic key check alone drops acme's
    device, host and disk copies (polled over the check, not timed)."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    master = tmp_path / "master.key"
    master.write_bytes(os.urandom(32))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "acme", "sk-admin": {"tenant": "ops", "admin": True}}}))
    a = serve(*fleet_flags(keys, master, tmp_path / "a", redis_url, "0.2"))
    b = serve(*fleet_flags(keys, master, tmp_path / "b", redis_url, "0.2"), "--host-cache-bytes", "8MiB")
    cached(a)
    assert cached(b) > 0  # b holds acme's KV now: device and host/disk copies
    assert cached(b, prompt=PROMPT + "b's own continuation") > 0

    def held(s) -> int:
        tiers = call(s, "GET", "/v1/cache", "sk-a").json()["tiers"]
        return sum(tiers[t]["blocks"] for t in ("device", "host", "disk") if t in tiers)

    assert held(b) > 0
    res = call(a, "DELETE", "/v1/cache", "sk-a")
    assert res.status_code == 200 and res.json()["data_key_destroyed"] is True, res.text
    for _ in range(600):  # bounded polling over the 0.2 s check (no timed assertion)
        if held(b) == 0:
            break
        time.sleep(0.05)
    assert held(b) == 0, call(b, "GET", "/v1/cache", "sk-a").text
    for s in (a, b):
        ok = call(s, "POST", "/admin/check_integrity", "sk-admin")
        assert ok.status_code == 200 and ok.json()["ok"] is True and ok.json()["num_unfinished"] == 0
