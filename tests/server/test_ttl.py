"""A tenant's ttl_s bounds how long its KV lives in every tier: the sweeper drops it from
device, host and disk, and Redis entries carry the TTL themselves. Other tenants keep theirs."""

from __future__ import annotations

import json
import time

import httpx
import pytest

redis = pytest.importorskip("redis")

PROMPT = "Short-lived context that this tenant's policy allows to be cached for one second. " * 2


@pytest.fixture(scope="module")
def ttl_server(serve, tmp_path_factory, redis_url):
    d = tmp_path_factory.mktemp("ttl")
    keys = d / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-t": "temp", "sk-k": "keeper"}, "tenants": {"temp": {"ttl_s": 1.0}}}))
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
        "--ttl-sweep-interval-s",
        "0.25",
    )
    yield s
    assert "Traceback" not in s.log()


def call(s, method: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{s.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60, **kw)


def cached(s, key: str) -> int:
    r = call(
        s, "POST", "/v1/completions", key, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def usage(s, key: str) -> dict:
    return call(s, "GET", "/v1/cache", key).json()["tiers"]


def test_ttl_expires_a_tenants_kv_everywhere(ttl_server, redis_url):
    s = ttl_server
    assert cached(s, "sk-t") == 0 and cached(s, "sk-k") == 0
    for _ in range(100):
        u = usage(s, "sk-t")
        if u["disk"]["blocks"] and u["remote"]["blocks"]:
            break
        time.sleep(0.02)
    assert u["device"]["blocks"] and u["host"]["blocks"] and u["disk"]["blocks"]
    r = redis.Redis.from_url(redis_url)
    ttls = [r.pttl(k) for k in r.scan_iter(match="kvtier:*") if b"owner:" not in k]
    assert any(0 < t <= 1000 for t in ttls)  # temp's entries expire within its 1 s
    assert any(t == -1 for t in ttls)  # keeper's never do
    # the sweeper runs every --ttl-sweep-interval-s: wait (bounded) until it has removed them all
    deadline = time.monotonic() + 60.0
    while True:
        u = usage(s, "sk-t")
        if (u["device"]["blocks"], u["host"]["blocks"], u["disk"]["blocks"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, f"temp's KV outlived its TTL: {u}"
        time.sleep(0.05)
    assert not [k for k in r.scan_iter(match="kvtier:*") if b"owner:" not in k and r.pttl(k) > 0]
    assert cached(s, "sk-t") == 0  # recomputed: nothing of it survived
    assert cached(s, "sk-k") > 0  # the other tenant keeps its cache
    k = usage(s, "sk-k")
    assert k["device"]["blocks"] > 0 and k["disk"]["blocks"] > 0
