"""What Ray Serve costs per request: one kvtier replica through Ray Serve (its HTTP proxy, the
ingress deployment, a DeploymentHandle stream to the engine replica) against the same engine
behind `kvtier serve` alone, same flags, same model, one compute thread each.

Requests go one at a time, alternating between the two servers (the order flips every request,
so drift in the machine's load falls on both), each a distinct prompt of random words (no prefix
hits on either side), streamed. Reported per server and repeat: TTFT and end-to-end latency
medians and p95, and Ray's overhead: the difference of the medians.

    python benchmarks/ray_overhead.py --requests 100 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from fleet import MODEL_DIR, SMALL_MODEL, _one, _pct, ensure_model  # noqa: E402

from kvtier.bench.server import SERVED_MODEL_NAME, free_port, start  # noqa: E402


def _stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft"] for r in rows]
    total = [r["ttft"] + sum(r["itl"]) for r in rows]
    return {
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 2),
        "ttft_p95_ms": round(1000 * (_pct(ttft, 0.95) or 0.0), 2),
        "latency_p50_ms": round(1000 * statistics.median(total), 2),
        "latency_p95_ms": round(1000 * (_pct(total, 0.95) or 0.0), 2),
    }


async def _run(urls: dict[str, str], prompts: list[str], max_tokens: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
    names = list(urls)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for i, prompt in enumerate(prompts):
            for name in names if i % 2 == 0 else reversed(names):
                r = await _one(client, urls[name], SERVED_MODEL_NAME, prompt, max_tokens)
                if "error" in r:
                    raise RuntimeError(f"{name}: {r['error']}")
                out[name].append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100, help="requests per server and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import ray
    from ray import serve

    from kvtier.integrations.ray_serve import build_app

    ensure_model(args.model_dir)
    engine = {"dtype": "float32", "block-size": "8", "num-device-blocks": "2000", "max-model-len": "4096"}
    flags = [x for k, v in engine.items() for x in (f"--{k}", v)] + ["--num-threads", "1"]
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-ray-overhead-") as tmp:
        direct = start(str(args.model_dir), flags, Path(tmp) / "serve.log")
        env = {"PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, logging_level="warning")
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            app = build_app(
                {
                    "model": str(args.model_dir),
                    "num_replicas": 1,
                    "num_cpus": 1,
                    "router": "pow2",
                    "served-model-name": SERVED_MODEL_NAME,
                    **engine,
                }
            )
            serve.run(app, name="kvtier", route_prefix="/")
            urls = {"kvtier serve": direct.url, "Ray Serve (1 replica)": f"http://127.0.0.1:{port}"}
            rng = random.Random(0)
            vocab = SMALL_MODEL["vocab_size"]

            def prompts(n: int) -> list[str]:
                return [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(args.prompt_words)) for _ in range(n)]

            asyncio.run(_run(urls, prompts(5), args.max_tokens))  # warm both
            for rep in range(args.repeats):
                load0 = os.getloadavg()[0]
                t0 = time.perf_counter()
                rows = asyncio.run(_run(urls, prompts(args.requests), args.max_tokens))
                run = {name: _stats(r) for name, r in rows.items()}
                a, b = run["kvtier serve"], run["Ray Serve (1 replica)"]
                run["overhead_ttft_p50_ms"] = round(b["ttft_p50_ms"] - a["ttft_p50_ms"], 2)
                run["overhead_latency_p50_ms"] = round(b["latency_p50_ms"] - a["latency_p50_ms"], 2)
                run.update(repeat=rep, seconds=round(time.perf_counter() - t0, 1), load_1m=[load0, os.getloadavg()[0]])
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1))
        finally:
            serve.shutdown()
            ray.shutdown()
            direct.stop()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
