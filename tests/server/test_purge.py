"""DELETE /v1/cache removes the caller's KV from device, host, disk and Redis and destroys its
data key, so a copy of an encrypted file taken before the purge cannot be read after it; the
other tenant keeps its cache. GET /v1/cache reports the caller's usage per tier."""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest

pytest.importorskip("cryptography")
redis = pytest.importorskip("redis")

PROMPT_A = "Tenant A's private document, long enough to fill several KV blocks. " * 2
PROMPT_B = "Tenant B has a different document that must survive A's purge untouched. " * 2


@pytest.fixture(scope="module")
def purge_server(serve, tmp_path_factory, redis_url):
    d = tmp_path_factory.mktemp("purge")
    keys = d / "keys.json"
    keys.write_text(
        json.dumps({"keys": {"sk-a": "acme", "sk-b": "globex", "sk-admin": {"tenant": "ops", "admin": True}}})
    )
    s = serve(
        "--api-keys",
        str(keys),
        "--num-device-blocks",
        "128",
        "--host-cache-bytes",
        "4MiB",
        "--disk-cache-dir",
        str(d / "disk"),
        "--remote-cache-url",
        redis_url,
        "--kv-key-dir",
        str(d / "keys"),
    )
    yield s, d
    assert "Traceback" not in s.log()


def call(s, method: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{s.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60, **kw)


def complete(s, key: str, prompt: str) -> dict:
    r = call(
        s, "POST", "/v1/completions", key, json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    return r.json()


def wait_stored(s, key: str) -> dict:
    for _ in range(200):
        usage = call(s, "GET", "/v1/cache", key).json()["tiers"]
        if usage["disk"]["blocks"] > 0 and usage["remote"]["blocks"] > 0:
            return usage
        time.sleep(0.05)
    raise AssertionError(f"nothing reached disk and Redis: {usage}")


def test_purge_removes_every_copy_and_destroys_the_key(purge_server, redis_url):
    from kvtier.tiers.codec import CodecError, decode
    from kvtier.tiers.crypto import KeyDestroyedError, KeyStore

    s, d = purge_server
    complete(s, "sk-a", PROMPT_A)
    complete(s, "sk-b", PROMPT_B)
    usage_a = wait_stored(s, "sk-a")
    wait_stored(s, "sk-b")
    assert usage_a["device"]["blocks"] > 0 and usage_a["host"]["blocks"] > 0

    # acme's files, found through its manifest; keep a copy of one to try after the purge
    fp_dir = next(p for p in (d / "disk").iterdir() if p.is_dir())
    oid = hashlib.sha256(b"acme").hexdigest()[:32]
    manifest = (fp_dir / "owners" / f"{oid}.keys").read_text().splitlines()  # "<key hex> <time>"
    keys_a = list(dict.fromkeys(bytes.fromhex(line.split()[0]) for line in manifest))
    files_a = [fp_dir / k.hex()[:2] / f"{k.hex()}.kv" for k in keys_a]
    assert all(f.is_file() for f in files_a)
    stolen = files_a[0].read_bytes()
    files_b_before = {p for p in fp_dir.rglob("*.kv")} - set(files_a)
    r = redis.Redis.from_url(redis_url)
    redis_a = [k for k in r.scan_iter(match="kvtier:*") if any(x.hex().encode() in k for x in keys_a)]
    assert redis_a

    # another tenant cannot purge acme; acme purges itself
    assert call(s, "DELETE", "/v1/cache?tenant=acme", "sk-b").status_code == 403
    res = call(s, "DELETE", "/v1/cache", "sk-a").json()
    assert res["tenant"] == "acme" and res["data_key_destroyed"] is True
    assert res["deleted_blocks"]["device"] > 0 and res["deleted_blocks"]["disk"] == len(files_a)
    assert res["deleted_blocks"]["remote"] >= len(redis_a) and res["deleted_blocks"]["host"] > 0

    assert not any(f.exists() for f in files_a)
    assert not any(r.exists(k) for k in redis_a)
    assert files_b_before and all(f.exists() for f in files_b_before)
    usage = call(s, "GET", "/v1/cache", "sk-a").json()["tiers"]
    assert usage["device"]["blocks"] == 0 and usage["disk"]["blocks"] == 0 and usage["host"]["blocks"] == 0

    # the copy taken before the purge is unreadable: the key is gone, a new key does not fit
    store = KeyStore(d / "keys")
    with pytest.raises(KeyDestroyedError):
        store.cipher("acme", create=False)
    with pytest.raises(CodecError):
        decode(stolen, fingerprint=bytes.fromhex(fp_dir.name), key=keys_a[0], cipher=store.cipher("acme"))

    # acme starts from nothing; globex still hits
    assert complete(s, "sk-a", PROMPT_A)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(s, "sk-b", PROMPT_B)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    ok = call(s, "POST", "/admin/check_integrity", "sk-admin")
    assert ok.status_code == 200 and ok.json()["ok"]


def test_admin_purges_every_tenant(purge_server):
    s, d = purge_server
    complete(s, "sk-b", PROMPT_B + " again")
    wait_stored(s, "sk-b")
    assert call(s, "DELETE", "/v1/cache?all=true", "sk-b").status_code == 403
    res = call(s, "DELETE", "/v1/cache?all=true", "sk-admin").json()
    assert res["deleted_blocks"]["disk"] > 0 and res["data_keys_destroyed"] >= 1
    assert not list((d / "disk").rglob("*.kv")) and not list((d / "keys").glob("*.key"))
    assert complete(s, "sk-b", PROMPT_B)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert call(s, "POST", "/admin/check_integrity", "sk-admin").json()["ok"]
