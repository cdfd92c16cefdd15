"""RemoteTier against real redis-server processes: sharing, TTL, a server killed and restarted,
a paused server, and a Redis Cluster. No assertion depends on how fast the machine is: the
health gate runs on a ManualClock and fault latency on a recording sleep."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvtier.tiers.base import FaultConfig, FaultInjector, HealthGate
from kvtier.tiers.codec import load_tensor, store_tensor
from kvtier.tiers.remote import RemoteTier, parse_url

from .conftest import (
    FINGERPRINT,
    OTHER_FINGERPRINT,
    ManualClock,
    RedisProcess,
    env_with_repo_on_path,
    make_keys,
    wait_until,
)

SHAPE = (2, 4, 2, 64)


def block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i), dtype=torch.bfloat16)


def test_parse_url_forms() -> None:
    assert parse_url("redis://h:1/2") == ("redis://h:1/2", False)
    assert parse_url("valkey://h:1/0") == ("redis://h:1/0", False)
    assert parse_url("valkeys://u:p@h:1/0") == ("rediss://u:p@h:1/0", False)
    assert parse_url("redis+cluster://a:1,b:2") == ("redis://a:1,b:2", True)
    assert parse_url("redis://h:1?cluster=1&socket_timeout=2") == ("redis://h:1?socket_timeout=2", True)
    assert parse_url("rediss+cluster://a:1?ssl_ca_certs=/ca.pem") == ("rediss://a:1?ssl_ca_certs=%2Fca.pem", True)
    with pytest.raises(ValueError, match="valkey://"):
        parse_url("memcached://h:1")
    with pytest.raises(ValueError, match=r"unknown option 'ssl_ca_cert'.*ssl_ca_certs"):
        parse_url("rediss+cluster://a:1?ssl_ca_cert=/ca.pem")  # a typo is not silently dropped
    with pytest.raises(ValueError, match="needs a TLS URL: use rediss://"):
        parse_url("redis://h:1?ssl_ca_certs=/ca.pem")
    # a cluster URL's options reach RedisCluster converted as redis-py converts a server's
    startup = RemoteTier(
        "rediss+cluster://u:p%40ss@[::1]:7000,h2:7001?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none"
        "&ssl_check_hostname=false&socket_timeout=3",
        fingerprint=FINGERPRINT,
    )._cluster_startup()
    assert [(n.host, n.port) for n in startup.pop("startup_nodes")] == [("::1", 7000), ("h2", 7001)]
    assert startup == {
        "ssl": True,
        "username": "u",
        "password": "p@ss",
        "ssl_ca_certs": "/ca.pem",
        "ssl_cert_reqs": "none",
        "ssl_check_hostname": False,
        "socket_timeout": 3.0,
    }
    with pytest.raises(ValueError, match="db 0"):
        RemoteTier("redis+cluster://a:1,b:2/3", fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match="host:port"):
        RemoteTier("redis+cluster://a:1,b:x", fingerprint=FINGERPRINT)


def test_put_get_contains_prefix_delete(redis_server: RedisProcess) -> None:
    keys = make_keys(6)
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT)
    for i, key in enumerate(keys[:4]):
        assert store_tensor(tier, key, block(i), fingerprint=FINGERPRINT)
    assert tier.contains_prefix(keys) == 4 and tier.contains_prefix(keys[4:]) == 0
    assert torch.equal(load_tensor(tier, keys[3], fingerprint=FINGERPRINT), block(3))
    assert load_tensor(tier, keys[5], fingerprint=FINGERPRINT) is None
    raw_name = f"kvtier:{FINGERPRINT.hex()}:{keys[0].hex()}".encode()
    assert redis_server.client().exists(raw_name) == 1
    assert redis_server.client().ttl(raw_name) == -1  # no TTL unless asked
    assert sorted(tier.keys()) == sorted(keys[:4])
    assert tier.delete(keys[1]) and not tier.delete(keys[1])
    assert tier.contains_prefix(keys) == 1
    # another configuration's entries are invisible, and a foreign frame is rejected
    other = RemoteTier(redis_server.url, fingerprint=OTHER_FINGERPRINT)
    assert other.contains_prefix(keys) == 0 and list(other.keys()) == []
    assert tier.usage_bytes == 3 * len(tier.get(keys[0]))
    assert tier.clear() == 3 and list(tier.keys()) == [] and tier.usage_bytes == 0
    s = tier.stats
    assert s.errors == {} and s.puts == 4 and s.deletes == 4 and tier.healthy


def test_ttl_expires_entries(redis_server: RedisProcess) -> None:
    a, b = make_keys(2)
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT, ttl_s=60)
    assert tier.put(a, b"frame-a")
    assert 0 < redis_server.client().pttl(f"kvtier:{FINGERPRINT.hex()}:{a.hex()}") <= 60_000
    assert tier.put(b, b"frame-b", ttl_s=0.001)  # a per-put TTL overrides the default
    # the server expires it on its own clock: poll for that (bounded), then check the effect
    wait_until(lambda: tier.get(b) is None and tier.usage_bytes == len(b"frame-a"), "b to expire", 10)
    assert tier.contains_prefix([a, b]) == 1 and tier.get(a) == b"frame-a"


def test_two_processes_share_entries(redis_server: RedisProcess) -> None:
    keys = make_keys(3)
    reader = RemoteTier(redis_server.url, fingerprint=FINGERPRINT)
    writer = RemoteTier(redis_server.url, fingerprint=FINGERPRINT)
    assert store_tensor(writer, keys[0], block(7), fingerprint=FINGERPRINT)
    assert torch.equal(load_tensor(reader, keys[0], fingerprint=FINGERPRINT), block(7))
    # a real second process (no torch needed to move frames)
    script = (
        "import sys; from kvtier.tiers.remote import RemoteTier\n"
        "t = RemoteTier(sys.argv[1], fingerprint=bytes(range(16)))\n"
        "keys = [bytes.fromhex(k) for k in sys.argv[2:]]\n"
        "assert t.contains_prefix(keys) == 1, t.stats\n"
        "assert t.put(keys[1], t.get(keys[0]) + b'')\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, redis_server.url, keys[0].hex(), keys[1].hex()],
        check=True,
        env=env_with_repo_on_path(),
        timeout=60,
    )
    assert reader.contains_prefix(keys) == 2
    assert reader.get(keys[1]) == reader.get(keys[0])


def test_server_killed_mid_run_then_restarted(redis_server: RedisProcess) -> None:
    keys = make_keys(4)
    clock = ManualClock()
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT, timeout_s=0.5, health=HealthGate(clock=clock))
    assert tier.put(keys[0], b"before")
    redis_server.kill()
    # misses and failed puts, no exception
    assert tier.get(keys[0]) is None
    assert not tier.healthy and tier.stats.errors == {"connection": 1}
    assert not tier.put(keys[1], b"during") and tier.contains_prefix(keys) == 0
    assert list(tier.keys()) == [] and tier.stats.skipped == 3  # gated: the backend is not asked
    redis_server.start()  # same port, empty (no persistence)
    assert not tier.put(keys[2], b"early")  # still inside the backoff: not even asked
    clock.advance(0.5)  # the first backoff
    assert tier.put(keys[2], b"after") and tier.healthy
    assert tier.get(keys[0]) is None and tier.get(keys[2]) == b"after"
    assert tier.contains_prefix(keys[2:]) == 1  # the prefix script is reloaded on the new server
    assert tier.stats.errors == {"connection": 1}


def test_server_down_at_start_is_not_an_error_for_the_caller(redis_binary: str, tmp_path) -> None:
    from .conftest import free_port

    server = RedisProcess(redis_binary, tmp_path / "late", free_port())
    (a,) = make_keys(1)
    clock = ManualClock()
    tier = RemoteTier(server.url, fingerprint=FINGERPRINT, timeout_s=0.5, health=HealthGate(clock=clock))
    assert tier.get(a) is None and not tier.healthy
    server.start()
    try:
        clock.advance(0.5)
        assert tier.put(a, b"x") and tier.get(a) == b"x"
    finally:
        server.stop()


def _get_calls(server: RedisProcess) -> int:
    return server.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def test_paused_server_times_out_and_recovers(redis_server: RedisProcess) -> None:
    (a,) = make_keys(1)
    clock = ManualClock()
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT, timeout_s=0.2, health=HealthGate(clock=clock))
    assert tier.put(a, b"x")
    redis_server.pause()
    try:
        assert tier.get(a) is None
        assert tier.stats.errors == {"timeout": 1} and not tier.healthy
    finally:
        redis_server.resume()
    # timeouts are never retried: the server, once resumed, finds that one GET in its sockets
    # (bounded poll until it has read them; a retry would have queued a second GET beside it)
    try:
        wait_until(lambda: _get_calls(redis_server) >= 1, "the queued GET", 2)
    except RuntimeError:
        pass  # the server may drop a command whose client hung up: 0 is no retry either
    assert _get_calls(redis_server) <= 1
    clock.advance(0.5)
    assert tier.get(a) == b"x" and tier.healthy


def test_fault_injection_applies_to_remote_tier(redis_server: RedisProcess) -> None:
    (a,) = make_keys(1)
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT)
    slept: list[float] = []
    tier.faults = FaultInjector(FaultConfig(latency_s=0.02), sleep=slept.append)
    assert tier.put(a, b"x") and tier.get(a) == b"x"
    assert slept == [0.02, 0.02]  # one latency per operation that reached the server
    assert tier.faults.latency_s == 0.02


def test_valkey_url_is_accepted(redis_server: RedisProcess) -> None:
    (a,) = make_keys(1)
    tier = RemoteTier(f"valkey://127.0.0.1:{redis_server.port}/3", fingerprint=FINGERPRINT)
    assert tier.put(a, b"x") and tier.get(a) == b"x"
    assert redis_server.client().execute_command("SELECT", 3) and tier.healthy
    import redis

    assert redis.Redis(port=redis_server.port, db=3).exists(f"kvtier:{FINGERPRINT.hex()}:{a.hex()}")


@pytest.mark.parametrize("form", ["scheme", "query"])
def test_cluster_spreads_keys_over_all_nodes(redis_cluster: list[RedisProcess], cluster_url: str, form: str) -> None:
    url = cluster_url if form == "scheme" else f"redis://127.0.0.1:{redis_cluster[0].port}?cluster=1"
    # 12 chains of 10 blocks: each chain's first block starts a run (one slot per run of a
    # chain, kvcache/keys.py), so 12+ runs fall on the three primaries
    keys = [k for salt in range(12) for k in make_keys(10, salt=100 + salt + 20 * (form == "query"))]
    tier = RemoteTier(url, fingerprint=FINGERPRINT, key_prefix=f"kv-{form}")
    assert tier.cluster
    for i, key in enumerate(keys):
        assert store_tensor(tier, key, block(i % 8), fingerprint=FINGERPRINT)
    per_node = [n.client().dbsize() for n in redis_cluster[:3]]  # the primaries
    assert all(count > 0 for count in per_node), per_node  # every node holds some
    assert tier.contains_prefix(keys) == len(keys)
    assert all(
        torch.equal(load_tensor(tier, k, fingerprint=FINGERPRINT), block(i % 8))
        for i, k in enumerate(keys[::10])
        for i in [keys.index(k)]
    )
    assert tier.delete(keys[50]) and tier.contains_prefix(keys) == 50  # "chains" in one list
    assert sorted(tier.keys()) == sorted(keys[:50] + keys[51:])
    assert tier.clear() == len(keys) - 1 and tier.contains_prefix(keys) == 0
    assert tier.stats.errors == {} and tier.healthy
    tier.close()


def test_foreign_frame_is_reported_and_deleted(redis_server: RedisProcess) -> None:
    a, b = make_keys(2)
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT)
    assert store_tensor(tier, a, block(1), fingerprint=FINGERPRINT)
    assert tier.put(b, tier.get(a))  # a's frame under b's key
    assert load_tensor(tier, b, fingerprint=FINGERPRINT) is None
    assert tier.stats.corrupt == 1 and tier.contains_prefix([b]) == 0
    assert torch.equal(load_tensor(tier, a, fingerprint=FINGERPRINT), block(1))


def test_concurrent_workers_share_one_tier(redis_server: RedisProcess) -> None:
    import threading

    keys = make_keys(32)
    tier = RemoteTier(redis_server.url, fingerprint=FINGERPRINT)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for step in range(60):
                i = (offset * 5 + step) % len(keys)
                if step % 2:
                    assert store_tensor(tier, keys[i], block(i % 8), fingerprint=FINGERPRINT)
                else:
                    out = load_tensor(tier, keys[i], fingerprint=FINGERPRINT)
                    assert out is None or torch.equal(out, block(i % 8))
                    tier.contains_prefix(keys[i : i + 4])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and tier.stats.errors == {} and tier.stats.corrupt == 0


def _probe_after_backoff(tier: RemoteTier, clock: ManualClock) -> None:
    clock.advance(tier.health.retry_in_s)


def test_cluster_node_killed_mid_run_then_restarted(redis_binary: str, tmp_path) -> None:
    """A primary without replicas dies: its keys miss, then the whole cluster reports
    CLUSTERDOWN; no exception reaches the caller. Restarted, the node rejoins (empty) and the
    tier recovers after its backoff, rebuilding its cluster client."""
    from .conftest import _cluster_ok, start_cluster, wait_cluster_ok

    nodes = start_cluster(redis_binary, tmp_path)
    try:
        url = "valkey+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        clock = ManualClock()
        tier = RemoteTier(url, fingerprint=FINGERPRINT, timeout_s=0.5, health=HealthGate(clock=clock))
        keys = make_keys(30, salt=99)
        assert all(tier.put(key, b"v") for key in keys)
        nodes[1].kill()
        assert all(tier.get(key) in (b"v", None) for key in keys)  # misses, never raises
        assert not tier.healthy and tier.stats.skipped > 0  # the rest were gated
        # past the node timeout the survivors declare the cluster down: still only misses
        wait_until(lambda: not _cluster_ok(nodes[0]), "the cluster to report a failure", 30)
        _probe_after_backoff(tier, clock)
        assert tier.contains_prefix(keys) == 0 and not tier.healthy
        assert set(tier.stats.errors) <= {"connection", "cluster", "timeout"}
        assert tier.stats.num_errors >= 2
        nodes[1].start()
        wait_cluster_ok(nodes)
        _probe_after_backoff(tier, clock)
        assert tier.put(keys[0], b"w") and tier.healthy, tier.stats
        assert all(tier.put(key, b"w") for key in keys)
        assert tier.contains_prefix(keys) == len(keys)
    finally:
        for node in nodes:
            node.stop()


def test_get_many_is_one_batch_with_misses_in_place(redis_server):
    from kvtier.tiers.remote import RemoteTier

    tier = RemoteTier(redis_server.url, fingerprint=b"g" * 16)
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys[:3]:
        assert tier.put(k, b"payload-" + k[:1])
    got = tier.get_many(keys)
    assert got[:3] == [b"payload-" + k[:1] for k in keys[:3]] and got[3:] == [None, None]
    st = tier.stats
    assert st.queries == 5 and st.hits == 3
    redis_server.kill()
    assert tier.get_many(keys) == [None] * 5  # a dead server is misses, never an exception
    tier.close()
