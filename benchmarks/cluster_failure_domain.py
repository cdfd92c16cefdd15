"""Redis Cluster failure domain of block keys: how chains should be spread over the masters.

    python benchmarks/cluster_failure_domain.py [--chains 64] [--blocks 128] [--frame-kib 64]

Starts a real cluster on loopback ports: 3 masters with one replica each (redis-server
processes, `redis-cli --cluster create --cluster-replicas 1`, cluster-require-full-coverage no
so that the surviving masters keep serving). For each naming scheme it stores `chains` chains of
`blocks` frames and measures:

  restore_ms      restoring one whole chain with pipelined GETs (as RemoteTier.get_many does):
                  median, p10, p90 over every chain, `repeats` times
  balance         keys and bytes per master: max / mean
  readable        after one master AND its replica die (no failover possible), the mean
                  fraction of each chain's LEADING blocks still readable (a restore stops at
                  the first miss), and the fraction of chains fully readable. Measured by a
                  real GET of every key on the master that owned its slot, over `loss_chains`
                  chains of small values (placement is all that matters; more chains, less noise).

Schemes (the hash tag decides the slot, so the node):
  none      "<prefix>:<key hex>"               every block on its own slot (today's names)
  runN      "<prefix>:{<tag>}<key hex>"        tag = first 4 bytes of the run's first block:
                                               runs of N consecutive blocks share a node
  chain     "<prefix>:{<tag>}<key hex>"        tag = the chain's first block: one node per chain
  cdcN      "<prefix>:{<key[:4]>}<key hex>"    kvtier's keys (kvcache/keys.py) with RUN_BLOCKS=N:
                                               content-defined runs, N blocks on average; what
                                               RemoteTier names in a cluster (cdc32 is the default)
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvtier.kvcache import keys as kvkeys


def _free_port_pair() -> int:
    for _ in range(1000):
        port = random.randint(20000, 55000)
        ok = True
        for p in (port, port + 10000):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no free port pair")


class Cluster:
    """3 masters + 3 replicas on loopback, torn down by stop()."""

    def __init__(self, root: Path, num_masters: int = 3) -> None:
        self.root = root
        self.procs: dict[int, subprocess.Popen] = {}
        binary = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if binary is None or cli is None:
            sys.exit("redis-server and redis-cli are needed (apt-get install redis-server)")
        ports = [_free_port_pair() for _ in range(2 * num_masters)]
        for port in ports:
            d = root / str(port)
            d.mkdir(parents=True)
            self.procs[port] = subprocess.Popen(
                [
                    binary,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(d),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-require-full-coverage",
                    "no",
                    "--protected-mode",
                    "no",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for port in ports:
            self._wait(lambda port=port: self.client(port).ping())
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
        )
        self._wait(lambda: all(self.client(p).cluster("info")["cluster_state"] == "ok" for p in ports))
        self.masters = [p for p in ports if self.client(p).execute_command("ROLE")[0] == b"master"]
        self.replica_of: dict[int, int] = {}
        for p in ports:
            info = self.client(p).info("replication")
            if info["role"] == "slave":
                self.replica_of[int(info["master_port"])] = p
        self._wait(
            lambda: all(
                self.client(p).info("replication").get("master_link_status") == "up" for p in self.replica_of.values()
            )
        )

    @staticmethod
    def client(port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=10)

    @staticmethod
    def _wait(cond, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if cond():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not get ready")
            time.sleep(0.05)

    def cluster_client(self) -> RedisCluster:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.masters], socket_timeout=10)

    def slot_owner(self) -> list[int]:
        owner = [0] * 16384
        for start, end, master, *_ in self.client(self.masters[0]).execute_command("CLUSTER", "SLOTS"):
            for s in range(start, end + 1):
                owner[s] = int(master[1])
        return owner

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait()


def chain_keys(chain: int, num_blocks: int) -> list[bytes]:
    parent, out = hashlib.blake2b(b"bench-root-%d" % chain, digest_size=16).digest(), []
    for i in range(num_blocks):
        parent = hashlib.blake2b(parent + i.to_bytes(8, "little"), digest_size=16).digest()
        out.append(parent)
    return out


def kvtier_chain_keys(chain: int, num_blocks: int, run_blocks: int) -> list[bytes]:
    saved, kvkeys.RUN_BLOCKS = kvkeys.RUN_BLOCKS, run_blocks
    try:
        parent, out = kvkeys.root_key(b"bench" * 3 + b"!", f"chain-{chain}"), []
        for i in range(num_blocks):
            parent = kvkeys.hash_id_key(parent, i)
            out.append(parent)
        return out
    finally:
        kvkeys.RUN_BLOCKS = saved


def names(scheme: str, keys: list[bytes], prefix: str) -> list[bytes]:
    if scheme.startswith("cdc"):
        return [f"{prefix}:{{{k[:4].hex()}}}{k.hex()}".encode() for k in keys]
    if scheme == "none":
        return [f"{prefix}:{k.hex()}".encode() for k in keys]
    run = len(keys) if scheme == "chain" else int(scheme[3:])
    return [f"{prefix}:{{{keys[i - i % run][:4].hex()}}}{k.hex()}".encode() for i, k in enumerate(keys)]


def scheme_keys(scheme: str, chain: int, num_blocks: int) -> list[bytes]:
    if scheme.startswith("cdc"):
        return kvtier_chain_keys(chain, num_blocks, int(scheme[3:]))
    return chain_keys(chain, num_blocks)


def measure_scheme(cluster: Cluster, scheme: str, args: argparse.Namespace) -> dict:
    rc = cluster.cluster_client()
    frame = os.urandom(args.frame_kib * 1024)
    chains = [names(scheme, scheme_keys(scheme, c, args.blocks), f"fd-{scheme}") for c in range(args.chains)]
    for chain in chains:
        for start in range(0, len(chain), 32):
            pipe = rc.pipeline()
            for name in chain[start : start + 32]:
                pipe.set(name, frame)
            pipe.execute()
    owner = cluster.slot_owner()
    keys_per = {m: 0 for m in cluster.masters}
    for chain in chains:
        for name in chain:
            keys_per[owner[key_slot(name)]] += 1
    times_ms = []
    for _ in range(args.repeats):
        for chain in chains:
            t0 = time.perf_counter()
            pipe = rc.pipeline()
            for name in chain:
                pipe.get(name)
            out = pipe.execute()
            times_ms.append((time.perf_counter() - t0) * 1e3)
            assert all(v is not None and len(v) == len(frame) for v in out)
    mean_keys = statistics.fmean(keys_per.values())
    q = statistics.quantiles(times_ms, n=10)
    rc.close()
    for m in cluster.masters:
        cluster.client(m).flushall()
    return {
        "restore_ms": {"median": round(statistics.median(times_ms), 2), "p10": round(q[0], 2), "p90": round(q[-1], 2)},
        "restore_mb_per_s": round(args.blocks * len(frame) / 1e6 / (statistics.median(times_ms) / 1e3), 1),
        "keys_per_master": sorted(keys_per.values()),
        "balance_max_over_mean": round(max(keys_per.values()) / mean_keys, 3),
    }


def measure_loss(cluster: Cluster, schemes: list[str], args: argparse.Namespace) -> dict:
    """Small values under every scheme's names, then one master and its replica die."""
    rc = cluster.cluster_client()
    all_chains = {
        s: [names(s, scheme_keys(s, c, args.blocks), f"fl-{s}") for c in range(args.loss_chains)] for s in schemes
    }
    for chains in all_chains.values():
        for chain in chains:
            pipe = rc.pipeline()
            for name in chain:
                pipe.set(name, b"v")
            pipe.execute()
    rc.close()
    owner = cluster.slot_owner()
    victim = cluster.masters[1]
    cluster.kill(victim)
    cluster.kill(cluster.replica_of[victim])
    alive = {m: cluster.client(m) for m in cluster.masters if m != victim}
    out = {}
    for scheme, chains in all_chains.items():
        leading, whole = [], 0
        for chain in chains:
            n = 0
            for name in chain:  # a real read on the owner; the dead node's slots are misses
                node = owner[key_slot(name)]
                if node not in alive or alive[node].get(name) != b"v":
                    break
                n += 1
            leading.append(n / len(chain))
            whole += n == len(chain)
        out[scheme] = {
            "leading_fraction_readable": round(statistics.fmean(leading), 3),
            "chains_fully_readable": round(whole / len(chains), 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chains", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--frame-kib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loss-chains", type=int, default=1024)
    ap.add_argument("--schemes", default="none,run8,run16,run32,chain,cdc16,cdc32")
    args = ap.parse_args()
    schemes = args.schemes.split(",")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvtier-fd-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            per_scheme = {s: measure_scheme(cluster, s, args) for s in schemes}
            loss = measure_loss(cluster, schemes, args)
        finally:
            cluster.stop()
    for s in schemes:
        per_scheme[s]["one_master_lost"] = loss[s]
    print(
        json.dumps(
            {
                "config": {
                    "chains": args.chains,
                    "blocks": args.blocks,
                    "frame_kib": args.frame_kib,
                    "repeats": args.repeats,
                    "loss_chains": args.loss_chains,
                    "masters": 3,
                    "replicas_per_master": 1,
                },
                "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
                "schemes": per_scheme,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
