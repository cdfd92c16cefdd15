"""A Redis Cluster with replicas loses a primary: its replica is promoted, and the tier, once
its gate lets a probe through (driven by a ManualClock), restores the whole prefix intact.
Also: a run of blocks (one run tag, kvcache/keys.py) lands on one slot."""

from __future__ import annotations

from pathlib import Path

from redis.crc import key_slot

from kvtier.tiers.base import HealthGate
from kvtier.tiers.remote import RemoteTier

from .conftest import FINGERPRINT, ManualClock, RedisProcess, _cluster_ok, make_keys, role, start_cluster, wait_until


def test_each_run_of_a_chain_lives_on_one_slot(redis_cluster: list[RedisProcess], cluster_url: str) -> None:
    tier = RemoteTier(cluster_url, fingerprint=FINGERPRINT, key_prefix="kv-runs")
    keys = make_keys(256, salt=7)
    tags = [k[:4] for k in keys]
    runs = [t for i, t in enumerate(tags) if i == 0 or t != tags[i - 1]]
    assert 2 < len(runs) < 64 and len(set(runs)) == len(runs)  # ~32 blocks a run, never revisited
    slots = {key_slot(tier._name(k)) for k in keys}
    assert len(slots) == len(runs)
    assert all(tier.put(key, b"v") for key in keys)
    assert sorted(tier.keys()) == sorted(keys)  # names with "{tag}" parse back to keys
    assert tier.clear() == len(keys)


def _primary_of(nodes: list[RedisProcess], replica: RedisProcess) -> int:
    return int(replica.client().info("replication")["master_port"])


def test_primary_lost_replica_promoted_prefix_restored(redis_binary: str, tmp_path: Path) -> None:
    nodes = start_cluster(redis_binary, tmp_path, replicas=1)
    primaries, replicas = nodes[:3], nodes[3:]
    try:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in primaries)
        clock = ManualClock()
        tier = RemoteTier(url, fingerprint=FINGERPRINT, timeout_s=0.5, health=HealthGate(clock=clock))
        keys = make_keys(96, salt=3)
        frames = [b"frame-%d-" % i + key for i, key in enumerate(keys)]
        assert all(tier.put(key, frame) for key, frame in zip(keys, frames))
        for replica in replicas:  # replication is asynchronous: let every replica catch up
            primary = next(p for p in primaries if p.port == _primary_of(nodes, replica))
            wait_until(lambda r=replica, p=primary: r.client().dbsize() == p.client().dbsize(), "replication", 20)
        # the victim: the primary holding the prefix's first block, so a restore needs failover
        victim = next(p for p in primaries if p.client().exists(tier._name(keys[0])))
        heir = next(r for r in replicas if _primary_of(nodes, r) == victim.port)
        victim.kill()
        assert tier.get_many(keys) == [None] * len(keys) and not tier.healthy
        survivors = [n for n in nodes if n is not victim]
        wait_until(
            lambda: role(heir) == "master" and all(_cluster_ok(n) for n in survivors), "the replica's promotion", 30
        )
        for _ in range(5):  # each failed probe doubles the backoff; the clock skips it
            clock.advance(tier.health.retry_in_s)
            if tier.contains_prefix(keys) == len(keys):
                break
        assert tier.healthy, tier.stats
        assert tier.contains_prefix(keys) == len(keys)
        assert tier.get_many(keys) == frames
        assert set(tier.stats.errors) <= {"connection", "cluster", "timeout"}
    finally:
        for node in nodes:
            node.stop()
