"""DELETE /v1/cache while Redis is unreachable: the answer is a 503 naming the remote tier as
not purged (the local tiers are), the purge is recorded on disk, the tenant's Redis entries are
neither read nor written meanwhile, and the purge completes once Redis answers again, even
across a restart of the server."""

from __future__ import annotations

import hashlib
import json
import os
import signal

import httpx
import pytest

pytest.importorskip("cryptography")
redis = pytest.importorskip("redis")

PROMPT = "Tenant A's document that must leave Redis even if Redis is away when asked. " * 2


@pytest.fixture
def redis_proc(tmp_path):
    """A redis-server of this test's own, so it can be stopped (SIGSTOP) and resumed."""
    from serverutil import start_redis, stop_redis

    proc, url = start_redis(tmp_path)
    yield proc, url
    stop_redis(proc)


def call(s, method: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{s.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)


def cached(s, key: str) -> int:
    r = call(
        s, "POST", "/v1/completions", key, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_purge_with_redis_down_says_so_and_completes_later(serve, tmp_path, redis_proc):
    from serverutil import stop_server

    proc, url = redis_proc
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "acme", "sk-admin": {"tenant": "ops", "admin": True}}}))
    flags = (
        "--api-keys",
        str(keys),
        "--disk-cache-dir",
        str(tmp_path / "disk"),
        "--remote-cache-url",
        url,
        "--kv-key-dir",
        str(tmp_path / "keys"),
        "--ttl-sweep-interval-s",
        "3600",
    )
    s = serve(*flags)
    cached(s, "sk-a")
    usage = call(s, "GET", "/v1/cache", "sk-a").json()["tiers"]  # waits for the queued stores
    assert usage["remote"]["blocks"] > 0 and usage["disk"]["blocks"] > 0
    r = redis.Redis.from_url(url)
    entries = [k for k in r.scan_iter(match="kvtier:*") if b":owner:" not in k]
    assert len(entries) == usage["remote"]["blocks"]

    os.kill(proc.pid, signal.SIGSTOP)  # Redis stops answering (connections hang, then time out)
    try:
        res = call(s, "DELETE", "/v1/cache", "sk-a")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert res.status_code == 503, res.text
    body = res.json()
    assert body["error"]["code"] == "purge_incomplete" and "remote" in body["error"]["message"]
    assert body["complete"] is False and body["pending"] == ["remote"]
    assert body["deleted_blocks"]["remote"] is None and body["deleted_blocks"]["disk"] == usage["disk"]["blocks"]
    assert body["data_key_destroyed"] is True
    oid = hashlib.sha256(b"acme").hexdigest()[:32]
    ledger = next((tmp_path / "keys").glob("pending-purges-*.json"))
    assert oid in json.loads(ledger.read_text())["pending"]
    assert all(r.exists(k) for k in entries)  # still there: nothing claimed otherwise

    # a restart keeps the record: the new process neither reads nor writes acme's Redis entries
    stop_server(s)
    s = serve(*flags)
    assert cached(s, "sk-a") == 0
    assert call(s, "GET", "/v1/cache", "sk-a").json()["tiers"]["disk"]["blocks"] == 0
    assert sorted(k for k in r.scan_iter(match="kvtier:*") if b":owner:" not in k) == sorted(entries)

    # Redis is back: the next purge finishes the recorded one first
    res = call(s, "DELETE", "/v1/cache", "sk-a")
    assert res.status_code == 200, res.text
    assert res.json()["complete"] is True and res.json()["pending"] == []
    assert not any(r.exists(k) for k in entries)
    assert list(r.scan_iter(match="kvtier:*")) == []
    assert json.loads(ledger.read_text())["pending"] == {}
    assert cached(s, "sk-a") == 0
    ok = call(s, "POST", "/admin/check_integrity", "sk-admin")
    assert ok.status_code == 200 and ok.json()["ok"] is True and ok.json()["num_unfinished"] == 0
