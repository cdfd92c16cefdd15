"""The remote tier comes back after an outage whichever operation probes first, says so in the
log at WARNING (rate-limited), and resyncs its usage with what the server still holds.

Real redis-server processes killed and restarted on the same port; the health gate and the log
limiter run on a ManualClock, so nothing here waits for a backoff."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from kvtier.tiers.base import FaultConfig, FaultInjector, HealthGate
from kvtier.tiers.remote import RemoteTier

from .conftest import FINGERPRINT, ManualClock, RedisProcess, make_keys

LOGGER = "kvtier.tiers.base"

PROBES: dict[str, Callable[[RemoteTier, list[bytes]], object]] = {
    "contains_prefix": lambda t, k: t.contains_prefix(k),
    "get": lambda t, k: t.get(k[0]),
    "get_many": lambda t, k: t.get_many(k),
    "put": lambda t, k: t.put(k[1], b"probe"),
    "delete": lambda t, k: t.delete(k[0]),
    "keys": lambda t, k: list(t.keys()),
    "clear": lambda t, k: t.clear(),
    "record_owner": lambda t, k: t.record_owner("tenant-a", k),
    "owner_keys": lambda t, k: t.owner_keys("tenant-a"),
    "forget_owner": lambda t, k: t.forget_owner("tenant-a"),
}


def broken_tier(server: RedisProcess) -> tuple[RemoteTier, ManualClock, list[bytes]]:
    """A tier that stored keys, then saw its server die (unhealthy); the server is back, empty,
    on the same port, and the backoff has not elapsed yet."""
    clock = ManualClock()
    tier = RemoteTier(server.url, fingerprint=FINGERPRINT, timeout_s=0.5, health=HealthGate(clock=clock))
    keys = make_keys(4)
    assert all(tier.put(key, b"frame-%d" % i) for i, key in enumerate(keys))
    server.kill()
    assert tier.get(keys[0]) is None and not tier.healthy
    server.start()
    return tier, clock, keys


@pytest.mark.parametrize("op", sorted(PROBES))
def test_tier_recovers_whichever_operation_probes_first(redis_server: RedisProcess, op: str) -> None:
    tier, clock, keys = broken_tier(redis_server)
    assert tier.get(keys[0]) is None and tier.stats.skipped == 1  # inside the backoff
    clock.advance(0.5)
    PROBES[op](tier, keys)  # the one probe the gate lets through
    assert tier.healthy, f"{op} as the probe left the gate closed: {tier.stats}"
    assert tier.put(keys[2], b"after") and tier.get(keys[2]) == b"after"
    assert tier.stats.errors == {"connection": 1}


@pytest.mark.parametrize("op", sorted(PROBES))
def test_a_probe_against_a_still_dead_server_reports_failure(
    redis_server: RedisProcess, op: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No operation may claim a recovery without asking the server (keys() builds a lazy
    iterator: creating it is not the probe), and each failed probe doubles the backoff."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier, clock, keys = broken_tier(redis_server)
    redis_server.kill()
    clock.advance(0.5)
    PROBES[op](tier, keys)
    assert not tier.healthy and tier.health.backoff_s == 1.0, (op, tier.stats)
    assert not any("is back" in r.getMessage() for r in caplog.records)
    redis_server.start()
    clock.advance(1.0)
    assert tier.put(keys[0], b"x") and tier.healthy


def test_interrupted_probe_does_not_wedge_the_gate(redis_server: RedisProcess) -> None:
    tier, clock, keys = broken_tier(redis_server)

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    tier.faults = FaultInjector(FaultConfig(latency_s=0.001), sleep=interrupted)
    clock.advance(0.5)
    with pytest.raises(KeyboardInterrupt):
        tier.get(keys[0])  # the probe dies before it can report
    tier.faults = None
    assert tier.put(keys[1], b"again") and tier.healthy  # the next caller is the probe


def test_outage_and_recovery_are_logged_at_warning_once(
    redis_server: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = ManualClock()
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT, timeout_s=0.5, health=HealthGate(clock=clock))
    (a,) = make_keys(1)
    assert tier.put(a, b"x") and caplog.records == []
    redis_server.kill()
    for _ in range(3):  # the failure, then two failed probes: one WARNING, not three
        assert tier.get(a) is None
        clock.advance(tier.health.retry_in_s)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert messages[0].startswith("tier remote unavailable: connection: ")
    assert "skipping it for 0.5 s, requests recompute" in messages[0]
    assert caplog.records[0].levelno == logging.WARNING
    clock.advance(61)  # past the limiter's interval: the next failure is reported again
    assert tier.get(a) is None
    assert "get failed (connection)" in caplog.records[-1].getMessage()
    assert "(2 more since the last report)" in caplog.records[-1].getMessage()
    redis_server.start()
    clock.advance(tier.health.retry_in_s)
    caplog.clear()
    assert tier.put(a, b"y") and tier.healthy
    assert [r.getMessage() for r in caplog.records] == ["tier remote is back after 4 failures"]


def test_usage_is_resynced_after_the_server_restarts_empty(redis_server: RedisProcess) -> None:
    tier, clock, keys = broken_tier(redis_server)
    assert tier.usage_bytes == 4 * len(b"frame-0")  # stale: the server lost them
    clock.advance(0.5)
    assert tier.put(keys[0], b"new")  # the probe: the gate reopens, the tier resyncs
    assert tier.usage_bytes == len(b"new")
    assert tier.contains_prefix(keys) == 1


def test_usage_is_resynced_after_a_restart_the_retry_hid(redis_server: RedisProcess) -> None:
    """Killed and restarted between two commands: the pooled socket fails, redis-py's one retry
    reconnects, no operation fails, yet the accounted entries are gone."""
    clock = ManualClock()
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT, health=HealthGate(clock=clock))
    keys = make_keys(3)
    assert tier.put(keys[0], b"old-0") and tier.put(keys[1], b"old-1")
    redis_server.restart()
    assert tier.put(keys[2], b"new") and tier.healthy and tier.stats.errors == {}
    assert tier.get(keys[2]) == b"new"  # the next command resyncs
    assert tier.usage_bytes == len(b"new")


def test_lua_refused_by_acl_falls_back_to_exists(redis_server: RedisProcess, caplog: pytest.LogCaptureFixture) -> None:
    """A server whose ACL denies scripting (and INFO, as "-@dangerous" does): contains_prefix
    answers through pipelined EXISTS, says so once at WARNING, and the tier stays healthy."""
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.remote")
    redis_server.client().execute_command(
        "ACL", "SETUSER", "noscript", "on", ">pw", "~*", "+@all", "-@scripting", "-info"
    )
    url = f"redis://noscript:pw@127.0.0.1:{redis_server.port}/0"
    tier = RemoteTier(url, fingerprint=FINGERPRINT)
    keys = make_keys(3)
    assert tier.put(keys[0], b"a") and tier.put(keys[1], b"b")
    assert tier.contains_prefix(keys) == 2 and tier.contains_prefix(keys) == 2
    assert tier.healthy and tier.stats.errors == {}
    refused = [r.getMessage() for r in caplog.records if "refuses Lua" in r.getMessage()]
    assert len(refused) == 1 and "no permissions" in refused[0], caplog.records
