"""A tenant's ttl_s bounds how long its KV lives in every tier: the sweep drops it from device,
host and disk, and Redis entries carry the TTL themselves. Other tenants keep theirs.

Time passes on an injected clock, never by sleeping: the server runs in process (the app over
an EngineCore, driven through Starlette's TestClient), the clocks the TTL sweep reads
(`ExpiryClock`, injected as EngineTenants.clock and TenantAdmin.clock / wall_clock) run ahead
of the real ones by what the test advances, and the test runs the sweep itself (what the
periodic sweeper calls) instead of waiting for it. Redis expires entries
on its own real clock: the test asserts the TTL Redis holds (PTTL) and then drops what Redis
would drop once it passes, instead of waiting for it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

redis = pytest.importorskip("redis")
from starlette.testclient import TestClient  # noqa: E402 - after the skip: the server's extras

from kvtier import LLM  # noqa: E402
from kvtier.engine.frontend import make_engine_client  # noqa: E402
from kvtier.server.app import ServerConfig, build_app, tenant_settings  # noqa: E402
from kvtier.server.tenancy import ApiKeyResolver  # noqa: E402

PROMPT = "Short-lived context that this tenant's policy allows to be cached for one hour. " * 2
TTL_S = 3600.0
"""Long enough that nothing expires on a real clock while the test runs (Redis included)."""


class ExpiryClock:
    """monotonic() and time() `advanced` seconds ahead of the real clocks: what the TTL sweeps
    read as now (EngineTenants.clock for the device, TenantAdmin.clock / wall_clock for the
    host and disk tiers), while the entries keep their real stamps."""

    def __init__(self) -> None:
        self.advanced = 0.0

    def advance(self, seconds: float) -> None:
        self.advanced += seconds

    def monotonic(self) -> float:
        return time.monotonic() + self.advanced

    def time(self) -> float:
        return time.time() + self.advanced


@pytest.fixture
def clock() -> ExpiryClock:
    return ExpiryClock()


@pytest.fixture
def ttl_app(server_model_dir, tmp_path, redis_url, clock):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-t": "temp", "sk-k": "keeper"}, "tenants": {"temp": {"ttl_s": TTL_S}}}))
    llm = LLM(
        str(server_model_dir),
        dtype="float32",
        num_device_blocks=128,
        block_size=4,
        host_cache_bytes=4 << 20,
        disk_cache_dir=str(tmp_path / "disk"),
        remote_cache_url=redis_url,
    )
    llm.engine.tenants.clock = clock.monotonic  # the device sweep's now
    llm.engine.tiers.tenants.clock, llm.engine.tiers.tenants.wall_clock = clock.monotonic, clock.time  # host, disk
    # the periodic sweeper never fires during the test: the test sweeps itself
    config = ServerConfig(served_model_name="tiny", ttl_sweep_interval_s=24 * 3600.0)
    resolver = ApiKeyResolver.from_file(str(keys))
    ttls, quotas = tenant_settings(resolver)
    engine = make_engine_client(core=llm.engine, tenant_ttls=ttls, tenant_quotas=quotas)
    app = build_app(engine, llm.tokenizer, config, tenants=resolver)
    try:
        with TestClient(app) as client:
            yield client
    finally:
        llm.close()


def call(client: TestClient, method: str, path: str, key: str, **kw: Any) -> Any:
    return client.request(method, path, headers={"Authorization": f"Bearer {key}"}, **kw)


def cached(client: TestClient, key: str) -> int:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = call(client, "POST", "/v1/completions", key, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def usage(client: TestClient, key: str) -> dict:
    """The tenant's blocks per tier (the endpoint waits for the queued tier writes first)."""
    r = call(client, "GET", "/v1/cache", key)
    assert r.status_code == 200, r.text
    return {tier: u["blocks"] for tier, u in r.json()["tiers"].items()}


def entry_ttls(r: Any) -> dict[bytes, int]:
    """PTTL (ms; -1: none) of every KV entry in Redis (the tenants' owner sets left out)."""
    return {k: r.pttl(k) for k in r.scan_iter(match="kvtier:*") if b"owner:" not in k}


def test_ttl_expires_a_tenants_kv_everywhere(ttl_app, redis_url, clock):
    client = ttl_app
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    assert cached(client, "sk-t") == 0 and cached(client, "sk-k") == 0
    t, k = usage(client, "sk-t"), usage(client, "sk-k")
    assert min(t.values()) > 0 and min(k.values()) > 0, (t, k)  # in every tier: device, host, disk, remote

    # Redis holds temp's entries with its TTL (set when written, at most TTL_S), keeper's with none
    ttls = entry_ttls(r)
    temp_keys = [key for key, ms in ttls.items() if ms != -1]
    assert len(temp_keys) == t["remote"] and len(ttls) - len(temp_keys) == k["remote"], ttls
    assert all(0 < ttls[key] <= TTL_S * 1000 for key in temp_keys)

    # just before its TTL, a sweep keeps everything of temp
    clock.advance(TTL_S - 60.0)
    client.portal.call(client.app.state.engine.sweep)
    assert usage(client, "sk-t") == t

    # past it, the sweep drops temp's KV from device, host and disk
    clock.advance(120.0)
    client.portal.call(client.app.state.engine.sweep)
    after = usage(client, "sk-t")
    assert (after["device"], after["host"], after["disk"]) == (0, 0, 0), f"temp's KV outlived its TTL: {after}"
    # ... and Redis drops its entries once their PTTL runs out: do what it will do by then
    assert r.delete(*temp_keys) == len(temp_keys)
    assert usage(client, "sk-t")["remote"] == 0

    assert cached(client, "sk-t") == 0  # recomputed: nothing of it survived
    assert cached(client, "sk-k") > 0  # the other tenant keeps its cache
    kept = usage(client, "sk-k")
    assert kept["device"] > 0 and kept["host"] > 0 and kept["disk"] > 0 and kept["remote"] == k["remote"]
    assert sorted(entry_ttls(r).values()).count(-1) == k["remote"]  # keeper's entries still never expire
