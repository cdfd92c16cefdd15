"""Admin hardening: keys that share one tenant cannot purge it, and files of user data are
private. A server started with `--api-key K1 K2` (every key is the one shared default tenant) and
no admin credential refuses every key's purge with a clear 403 and keeps everyone's KV."""

from __future__ import annotations

import json
import os
import stat

import httpx

PROMPT = "Two plain keys share this cache; neither may wipe it for the other. " * 2
ADMIN_KEY = "adm-0123456789abcdef-hardening"


def req(s, method: str, path: str, key: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{s.url}{path}", headers=headers, timeout=60, **kw)


def cached(s, key: str) -> int:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    r = req(s, "POST", "/v1/completions", key, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_shared_api_keys_cannot_purge_without_an_admin_credential(serve):
    s = serve("--api-key", "sk-one", "sk-two", "--num-device-blocks", "128")
    cached(s, "sk-one")
    assert cached(s, "sk-two") > 0  # one shared tenant: the other key's prompt hits
    for key in ("sk-one", "sk-two"):
        for path in ("/v1/cache", "/v1/cache?all=true", "/v1/cache?tenant=default"):
            r = req(s, "DELETE", path, key)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["type"] == "permission_error"
            assert "--admin-key-file" in r.json()["error"]["message"], r.text
        assert req(s, "POST", "/admin/check_integrity", key).status_code == 403
    assert req(s, "DELETE", "/v1/cache").status_code == 401  # no key at all
    assert cached(s, "sk-one") > 0  # nothing was purged, nothing aborted
    usage = req(s, "GET", "/v1/cache", "sk-two")
    assert usage.status_code == 200 and usage.json()["tenant"] == "default"


def test_shared_api_keys_purge_needs_the_admin_key(serve, tmp_path):
    admin = tmp_path / "admin.key"
    admin.write_text(ADMIN_KEY)
    s = serve("--api-key", "sk-one", "sk-two", "--admin-key-file", str(admin), "--num-device-blocks", "128")
    cached(s, "sk-one")
    r = req(s, "DELETE", "/v1/cache", "sk-two")
    assert r.status_code == 403 and "shared by every key" in r.json()["error"]["message"], r.text
    assert cached(s, "sk-one") > 0
    r = req(s, "DELETE", "/v1/cache", ADMIN_KEY)  # the shared tenant: no ?tenant= needed
    assert r.status_code == 200 and r.json()["tenant"] == "default", r.text
    assert cached(s, "sk-two") == 0
    ok = req(s, "POST", "/admin/check_integrity", ADMIN_KEY)
    assert ok.status_code == 200 and ok.json()["ok"] is True


def test_own_tenant_key_purges_only_its_own_tenant(serve, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": "acme", "sk-b": "globex"}}))
    s = serve("--api-keys", str(keys), "--num-device-blocks", "128")
    cached(s, "sk-a")
    cached(s, "sk-b")
    assert req(s, "DELETE", "/v1/cache?tenant=globex", "sk-a").status_code == 403
    assert req(s, "DELETE", "/v1/cache?all=true", "sk-a").status_code == 403
    r = req(s, "DELETE", "/v1/cache", "sk-a")
    assert r.status_code == 200 and r.json()["tenant"] == "acme", r.text
    assert cached(s, "sk-b") > 0  # the other tenant keeps its KV


def test_request_log_is_private_whatever_the_umask(serve, tmp_path):
    log = tmp_path / "requests.jsonl"
    log.write_text("")
    os.chmod(log, 0o666)  # an existing file of the wrong mode is narrowed too
    s = serve("--request-log", str(log), "--num-device-blocks", "128")
    r = req(s, "POST", "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    fresh = tmp_path / "fresh.jsonl"
    old = os.umask(0)
    try:
        s2 = serve("--request-log", str(fresh), "--num-device-blocks", "128")
    finally:
        os.umask(old)
    assert (
        req(s2, "POST", "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}).status_code == 200
    )
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600
