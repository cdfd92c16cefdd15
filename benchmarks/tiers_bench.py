"""Tier benchmarks on the reference model (2048-token prefixes); prints one JSON object.

    python benchmarks/tiers_bench.py [--model /tmp/kvtier-ref] [--skip-pressure] [--repeats 3]
        [--scenarios quiet contended] [--pressure-configs host disk_only ...] [--out results.jsonl]

1. TTFT of the same prefix served from device, host, disk, Redis and by recompute, with the
   restore throughput against this machine's memcpy and O_DIRECT sequential disk read bandwidth
   (measured in the same run).
2. Pressure: a device pool of 21,760 tokens, 24 distinct 2048-token prefixes, each revisited
   after all were seen: revisit TTFT p50/p95 with host, disk-only, Redis-only, and device only.
3. The cost model under slowed storage (fault injection): for short and long prefixes, the
   path it chose and the measured TTFT of both paths.
Starts its own redis-server on a free loopback port (Debian's redis-server must be installed).

Scenarios: *quiet*, and *contended* (benchmarks/corunner.py keeps one core busy while the engines
run), each with the machine (matmul peak, memcpy, load) measured beside it, co-runner included.
Every TTFT is reported with all its repeats (per tier) or its distribution over the 24 revisits
(pressure). Writes to disk and Redis happen in the background; before a revisit the script waits
for them (`tiers.flush()`), so that they do not share the two cores with the timed request, and
reports that wait as `flush_s`: it is the time a write-back costs, paid off the request path.
`--out` appends each result to a JSON-lines file as it comes (a killed run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import corunner  # noqa: E402
import workloads as W  # noqa: E402
from build_reference_model import ensure_reference_model  # noqa: E402
from machine import measure, memcpy_gbps  # noqa: E402

BS = 16


def disk_read_gbps(directory: str, num_bytes: int = 512 << 20) -> float:
    """Sequential read with O_DIRECT (no page cache) of a freshly written file."""
    path = os.path.join(directory, "seqread.bin")
    chunk = 8 << 20
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(chunk))
    with open(path, "wb") as f:
        for _ in range(num_bytes // chunk):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        total = 0
        while True:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            total += n
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
        os.remove(path)
    return total / dt / 1e9


class Redis:
    def __init__(self, workdir: str) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--maxmemory",
                "8gb",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                break
            except Exception:
                time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def flushall(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def llm(model: str, **kw):
    from kvtier import LLM

    args = dict(
        dtype="bfloat16", block_size=BS, num_device_blocks=1024, skip_tokenizer_init=True, restore_policy="always"
    )
    args.update(kw)
    return LLM(model, **args)


LAST_RESTORE_S: list[float] = []


def ttft(engine, prompt: list[int]) -> tuple[float, dict, str | None]:
    from kvtier import SamplingParams

    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    LAST_RESTORE_S.append(out.restore_s)
    return out.metrics.ttft_s, out.cached_tokens_by_tier, out.restore_decision


def per_tier_ttft(model: str, redis_url: str, tmp: str, repeats: int) -> dict:
    res: dict[str, list] = {k: [] for k in ("device", "host", "disk", "remote", "recompute")}
    cached: dict[str, list] = {k: [] for k in res}
    restore_s: dict[str, list] = {k: [] for k in res}
    disk_dir = os.path.join(tmp, "disk-ttft")
    flush_s: list[float] = []
    warm = W.tokens(99, 2048)
    e = llm(model, host_cache_bytes=2 << 30, disk_cache_dir=disk_dir, remote_cache_url=redis_url)
    ttft(e, warm)
    prefixes = [W.tokens(300 + r, 2048) for r in range(repeats)]
    for r, prefix in enumerate(prefixes):
        ttft(e, prefix + W.tokens(400 + r, 16))
        flush_s.append(_timed_flush(e))  # background writes to disk/Redis would share the 2 cores
        t, c, _ = ttft(e, prefix + W.tokens(500 + r, 4))
        res["device"].append(t)
        cached["device"].append(c)
        e.reset_prefix_cache()
        t, c, _ = ttft(e, prefix + W.tokens(600 + r, 4))
        res["host"].append(t)
        cached["host"].append(c)
        restore_s["host"].append(LAST_RESTORE_S[-1])
    e.engine.tiers.flush()
    host_stats = e.engine.tiers.tier_stats()["host"]
    e.close()
    for name, kw in (
        ("disk", dict(disk_cache_dir=disk_dir)),
        ("remote", dict(remote_cache_url=redis_url)),
        ("recompute", {}),
    ):
        e = llm(model, **kw)
        ttft(e, warm)  # kernels primed; this prompt's blocks are not the measured ones
        for r, prefix in enumerate(prefixes):
            t, c, _ = ttft(e, prefix + W.tokens(700 + r, 4))
            res[name].append(t)
            cached[name].append(c)
            restore_s[name].append(LAST_RESTORE_S[-1])
            e.reset_prefix_cache()
        e.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    block_bytes = 2 * 12 * 4 * 64 * 2 * BS
    restored = 128 * block_bytes
    out = {f"ttft_{k}_ms": round(v * 1e3, 1) for k, v in med.items()}
    out["ttft_all_ms"] = {k: [round(x * 1e3, 1) for x in v] for k, v in res.items()}
    out["flush_s"] = [round(x, 3) for x in flush_s]
    out["cached_tokens_by_tier"] = {k: v[0] for k, v in cached.items()}
    out["restore_bytes"] = restored
    for k in ("host", "disk", "remote"):
        t = statistics.median(restore_s[k])  # the load job: read (+ decode, checksum) in the tier
        out[f"{k}_restore_ms"] = round(t * 1e3, 1)
        out[f"{k}_restore_gbps"] = round(restored / max(t, 1e-9) / 1e9, 2)
    out["host_read_gbps"] = round(host_stats.bytes_read / max(host_stats.read_s, 1e-9) / 1e9, 2)
    out["speedup_vs_recompute"] = {k: round(med["recompute"] / med[k], 1) for k in ("device", "host", "disk", "remote")}
    return out


def pressure(model: str, tmp: str, redis_url: str | None, **tier_kw) -> dict:
    spec = W.pressure()
    e = llm(model, num_device_blocks=21760 // BS, **tier_kw)
    ttft(e, W.tokens(99, 2048))
    first = [ttft(e, p)[0] for p in spec["first"]]
    flush_s = _timed_flush(e) if e.engine.tiers is not None else 0.0
    revisit, by_tier = [], []
    for p in spec["revisit"]:
        t, c, _ = ttft(e, p)
        revisit.append(t)
        by_tier.append(c)
    e.check_integrity()
    e.close()
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]  # noqa: E731
    tiers_used: dict[str, int] = {}
    for c in by_tier:
        for k, v in c.items():
            tiers_used[k] = tiers_used.get(k, 0) + v
    return {
        "first_p50_s": round(statistics.median(first), 3),
        "revisit_p50_s": round(statistics.median(revisit), 4),
        "revisit_p95_s": round(pct(revisit, 95), 4),
        "revisit_min_s": round(min(revisit), 4),
        "revisit_max_s": round(max(revisit), 4),
        "revisit_tokens_by_tier": tiers_used,
        "flush_s": round(flush_s, 3),
        "revisit_all_s": [round(x, 4) for x in revisit],
    }


def _timed_flush(e) -> float:
    t = time.perf_counter()
    e.engine.tiers.flush()
    return time.perf_counter() - t


def cost_model_check(model: str, tmp: str, fault_spec: str) -> dict:
    """Slow the disk (fault injection: every call, lookup or block read, pays the latency) and
    compare the chosen path with the other one. With 8 ms a call against ~12 ms to recompute a
    16-token block, one block does not pay for its lookup, 128 blocks do."""
    faults = {"disk": fault_spec}
    disk_dir = os.path.join(tmp, "disk-cost")
    out = {"faults": faults["disk"]}
    cases = {
        "short_24": W.tokens(800, 24 + 1),
        "medium_256": W.tokens(802, 256 + 1),
        "long_2048": W.tokens(801, 2048 + 4),
    }
    e = llm(model, disk_cache_dir=disk_dir)
    for p in cases.values():
        ttft(e, p)
    e.engine.tiers.flush()
    e.close()
    for name, p in cases.items():
        e = llm(model, disk_cache_dir=disk_dir, tier_faults=faults, restore_policy="cost")
        ttft(e, W.tokens(99, 2048))
        t_chosen, c, decision = ttft(e, p)
        e.close()
        e = llm(
            model,
            disk_cache_dir=disk_dir,
            tier_faults=faults,
            restore_policy="always" if decision == "recompute" else "cost",
        )
        if decision != "recompute":
            e.engine.tiers.cost.prefill.theta = [0.0, 0.0]  # make recompute look free: forced
            e.engine.tiers.cost.prefill.frozen = True
        ttft(e, W.tokens(99, 2048))
        t_other, _c2, d2 = ttft(e, p)
        e.close()
        out[name] = {
            "decision": decision,
            "ttft_chosen_ms": round(t_chosen * 1e3, 1),
            "other_path": d2,
            "ttft_other_ms": round(t_other * 1e3, 1),
            "chosen_is_faster": t_chosen < t_other,
            "cached": c,
        }
    return out


PRESSURE_CONFIGS = {
    "host": dict(host_cache_bytes=8 << 30),
    "disk_only": dict(disk_cache_dir="disk-p"),
    "redis_only": dict(remote_cache_url=None),
    "device_only": {},
    "host_write_back": dict(host_cache_bytes=8 << 30, cache_write_policy="write_back"),
    "host_selective": dict(host_cache_bytes=8 << 30, cache_write_policy="selective"),
}
"""Tier configurations of the pressure run (disk folders are under the run's temp folder; the
Redis URL is the run's own server)."""


def run_scenario(args, model: str, tmp: str, redis: Redis, record) -> dict:
    report: dict = {}
    if args.only in (None, "per_tier"):
        r = per_tier_ttft(model, redis.url, tmp, args.repeats)
        r["host_restore_fraction_of_memcpy"] = round(r["host_restore_gbps"] / args.memcpy_gbps, 2)
        r["disk_restore_fraction_of_seq_read"] = round(r["disk_restore_gbps"] / args.disk_gbps, 2)
        report["per_tier"] = r
        record("per_tier", r)
    if args.only in (None, "cost_model"):
        report["cost_model"] = cost_model_check(model, tmp, args.cost_faults)
        record("cost_model", report["cost_model"])
    if not args.skip_pressure and args.only in (None, "pressure"):
        report["pressure"] = {}
        for name in args.pressure_configs:
            kw = dict(PRESSURE_CONFIGS[name])
            if "disk_cache_dir" in kw:
                kw["disk_cache_dir"] = os.path.join(tmp, f"{kw['disk_cache_dir']}-{len(report['pressure'])}")
            if "remote_cache_url" in kw:
                redis.flushall()
                kw["remote_cache_url"] = redis.url
            report["pressure"][name] = pressure(model, tmp, None, **kw)
            record(f"pressure_{name}", report["pressure"][name])
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/kvtier-ref")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-pressure", action="store_true")
    ap.add_argument("--only", choices=["per_tier", "cost_model", "pressure"], default=None)
    ap.add_argument("--cost-faults", default="latency_ms=8", help="disk fault spec for the cost-model check")
    ap.add_argument(
        "--scenarios",
        nargs="+",
        default=["quiet"],
        choices=["quiet", "contended"],
        help="contended: benchmarks/corunner.py keeps one core busy while the engines run",
    )
    ap.add_argument("--pressure-configs", nargs="+", default=list(PRESSURE_CONFIGS), choices=list(PRESSURE_CONFIGS))
    ap.add_argument("--out", default=None, help="append each result to this JSON-lines file as it comes")
    args = ap.parse_args()
    model = str(ensure_reference_model(args.model))
    tmp = tempfile.mkdtemp(prefix="kvtier-tiers-", dir=os.environ.get("KVTIER_BENCH_DIR", "/tmp"))
    redis = Redis(tmp)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "scenarios": {}}
    try:
        args.memcpy_gbps = round(memcpy_gbps(), 2)
        args.disk_gbps = round(disk_read_gbps(tmp), 2)
        report["disk_seq_read_odirect_gbps"] = args.disk_gbps
        for scenario in args.scenarios:
            cores = 1 if scenario == "contended" else 0

            def record(name: str, result: dict, scenario: str = scenario) -> None:
                line = {"scenario": scenario, "result_of": name, "result": result}
                print(json.dumps(line), file=sys.stderr, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(line) + "\n")

            scenario_tmp = os.path.join(tmp, scenario)  # nothing stored by another scenario is found
            os.makedirs(scenario_tmp)
            redis.flushall()
            with corunner.running(cores):
                machine = measure()
                record("machine", machine)
                report["scenarios"][scenario] = {
                    "machine": machine,
                    **run_scenario(args, model, scenario_tmp, redis, record),
                }
    finally:
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
