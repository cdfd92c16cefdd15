"""benchmarks/fleet.py's trace replay against kvtier on Ray Serve (kvtier.integrations.ray_serve):
the same slice of the Mooncake trace, the same requests and the same per-policy figures, with
Ray Serve's request routers in place of vllm-router's policies, each from cold caches:

    kv_event   kvtier's KVEventRouter: the replicas' KV events (longest stored prefix)
    prefix     Ray's PrefixCacheAffinityRouter: a tree of the text it routed
    pow2       Ray's default power-of-two choices

optionally each again with a shared Redis tier (`--redis`). A local Ray cluster is started here
(`--ray-cpus`, default instances x threads) and shut down at the end.

    python benchmarks/ray_fleet.py --requests 200 --policies kv_event,pow2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from fleet import (  # noqa: E402
    MODEL_DIR,
    TRACE,
    check_outputs,
    plan,
    replay,
    summarize,
)

from kvtier.bench.server import free_port, start_redis_server, stop_process  # noqa: E402
from kvtier.integrations.ray_serve import ENGINE_DEPLOYMENT  # noqa: E402


class Killer(threading.Thread):
    """Kills one engine replica (its Ray actor; Ray Serve then replaces it) `after_s` seconds
    into the replay, as a crash would."""

    def __init__(self, after_s: float) -> None:
        super().__init__(daemon=True)
        self.after_s = after_s
        self.replica: str | None = None
        self.at: float | None = None

    def run(self) -> None:
        import ray

        time.sleep(self.after_s)
        names = sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and ENGINE_DEPLOYMENT in a["name"]
        )
        self.replica, self.at = names[0], time.perf_counter()
        ray.kill(ray.get_actor(self.replica, namespace="serve"), no_restart=False)


def kill_report(results: list[dict], killer: Killer, start: float, guard_s: float) -> dict[str, Any]:
    """What the kill did: the errors (all after it), requests answered by the dead replica after
    it (none may be), errors of requests sent after the health check had time to notice, and
    how the replacement replicas' hits came (from Redis: warm)."""
    assert killer.at is not None
    before = {r["replica"] for r in results if "error" not in r and r["sent"] < killer.at}
    new = [r for r in results if "error" not in r and r["replica"] not in before]
    errors = [r for r in results if "error" in r]
    return {
        "killed": killer.replica,
        "killed_at_s": round(killer.at - start, 1),
        "errors_before_kill": sum(1 for r in errors if r["sent"] < killer.at - 5.0),
        "errors_after_kill": len(errors),
        "answered_by_dead_replica_after_kill": sum(
            1 for r in results if "error" not in r and r["replica"] == killer.replica and r["sent"] > killer.at
        ),
        "errors_sent_after_health_check": sum(1 for r in errors if r["sent"] > killer.at + guard_s),
        "replacement_requests": len(new),
        "replacement_hit_tokens_by_tier": dict(
            sum((collections.Counter(r["by_tier"]) for r in new), collections.Counter())
        ),
    }


def run_policy(
    args: argparse.Namespace,
    policy: str,
    redis: bool,
    prompts: list,
    tmp: Path,
    url: str,
    reference: list[str] | None = None,
) -> dict:
    from ray import serve

    from kvtier.integrations.ray_serve import build_app

    redis_proc = None
    flags: dict[str, Any] = {}
    if redis:
        redis_proc, port = start_redis_server(tmp)
        flags = {"remote-cache-url": f"redis://127.0.0.1:{port}"}
    try:
        app = build_app(
            {
                "model": str(args.model_dir),
                "num_replicas": args.instances,
                "num_cpus": args.threads,
                "router": policy,
                "dtype": "float32",
                "block-size": args.tokens_per_id,
                "num-device-blocks": args.pool_blocks,
                "max-model-len": 8192,
                **flags,
            }
        )
        serve.run(app, name="kvtier", route_prefix="/")
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        killer = Killer(args.kill_after) if args.kill_after is not None else None
        if killer is not None:
            killer.start()
        results = asyncio.run(replay(url, str(args.model_dir), prompts, args))
        row = summarize(results, time.perf_counter() - t0)
        if reference is not None:
            row.update(check_outputs(results, reference))
        if killer is not None:
            killer.join()
            row["kill"] = kill_report(results, killer, t0, args.kill_guard_s)
        row.update(policy=policy, redis=redis, load_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
        per_replica = collections.Counter(r.get("replica") for r in results if "error" not in r)
        row["requests_per_instance"] = sorted(per_replica.values(), reverse=True)
        return row
    finally:
        serve.delete("kvtier")
        if redis_proc is not None:
            stop_process(redis_proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--start", type=int, default=0, help="first request of the slice")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--tokens-per-id", type=int, default=8, help="tokens per trace hash id (= the block size)")
    ap.add_argument("--instances", type=int, default=3, help="engine replicas")
    ap.add_argument("--pool-blocks", type=int, default=1500, help="device blocks per replica")
    ap.add_argument("--threads", type=int, default=1, help="CPUs (num_cpus) and compute threads per replica")
    ap.add_argument("--ray-cpus", type=int, default=None, help="the local Ray cluster's CPUs")
    ap.add_argument("--policies", default="kv_event,prefix,pow2")
    ap.add_argument("--redis", action="store_true", help="also run every policy with a shared Redis tier")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="replay the trace this many times faster")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--check-tokens", action="store_true", help="compare every output with kvtier's own greedy output")
    ap.add_argument(
        "--kill-after", type=float, default=None, metavar="S", help="kill one engine replica S seconds into each run"
    )
    ap.add_argument(
        "--kill-guard-s",
        type=float,
        default=5.0,
        help="with --kill-after: a request sent this long after the kill must not fail (health check period + margin)",
    )
    args = ap.parse_args()
    import ray
    from ray import serve

    prompts, reference, variants, report = plan(args)
    env = {"PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    ray.init(
        num_cpus=args.ray_cpus or args.instances * args.threads,
        include_dashboard=False,
        runtime_env={"env_vars": env},
        logging_level="warning",
    )
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        with tempfile.TemporaryDirectory(prefix="kvtier-ray-fleet-") as tmp:
            for policy, redis in variants:
                row = run_policy(args, policy, redis, prompts, Path(tmp), f"http://127.0.0.1:{port}", reference)
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
