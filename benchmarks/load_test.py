"""Load test of `kvtier serve`: concurrent streaming clients over loopback; prints one JSON object.

    python benchmarks/load_test.py [--model DIR] [--clients 64] [--duration-s 60] [--url URL]
                                   [-- extra kvtier serve flags]

Starts `kvtier serve` on a free loopback port (default model: the demo's byte-level model),
unless --url names a running server (loopback only). Each client streams one completion at a
time (shared system prompts plus a unique question, so the prefix cache works; 10% of clients
hang up early) until the duration ends; the run is bounded by --duration-s plus one request's
timeout. Then it checks /admin/check_integrity at idle. JSON: requests, errors, hung_up,
client TTFT (first streamed chunk) and engine TTFT p50/p95, output tokens/s, the server's RSS
before and after, the /metrics totals that matter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from kvtier.server.sse import aiter_events  # noqa: E402

MODEL_NAME = "load-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def start_server(model: str, extra: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--log-level",
        "warning",
        *extra,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"kvtier serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{url} did not become healthy in {timeout_s} s")


async def run_clients(url: str, clients: int, duration_s: float, max_tokens: int, seed: int) -> dict:
    import httpx

    prefixes = [f"System prompt {i}: you answer questions about topic {i} briefly and exactly. " * 3 for i in range(8)]
    stats: dict = {
        "requests": 0,
        "errors": [],
        "hung_up": 0,
        "tokens": 0,
        "client_ttft_s": [],
        "engine_ttft_s": [],
        "cached_tokens": 0,
        "prompt_tokens": 0,
    }
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            body = {
                "model": MODEL_NAME,
                "prompt": rng.choice(prefixes) + f"Question {rng.randrange(10**6)}?",
                "max_tokens": rng.randrange(max_tokens // 4, max_tokens + 1),
                "temperature": rng.choice([0.0, 0.7]),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            hang_up_after = rng.randrange(1, 5) if rng.random() < 0.10 else None
            t0 = time.perf_counter()
            first = None
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        stats["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    chunks, done = 0, False
                    async for chunk in aiter_events(r):
                        if chunk is None:
                            done = True
                            break
                        if "error" in chunk:
                            stats["errors"].append(chunk["error"]["message"])
                            continue
                        if chunk["choices"] and first is None:
                            first = time.perf_counter() - t0
                        if chunk.get("usage"):
                            u = chunk["usage"]
                            stats["tokens"] += u["completion_tokens"]
                            stats["prompt_tokens"] += u["prompt_tokens"]
                            stats["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
                            if chunk["kvtier"]["ttft_s"] is not None:
                                stats["engine_ttft_s"].append(chunk["kvtier"]["ttft_s"])
                        chunks += 1
                        if hang_up_after is not None and chunks >= hang_up_after:
                            stats["hung_up"] += 1
                            break
                    if hang_up_after is None and not done:
                        stats["errors"].append("stream ended without [DONE]")
                    stats["requests"] += 1
                    if first is not None and hang_up_after is None:
                        stats["client_ttft_s"].append(first)
            except httpx.HTTPError as e:
                stats["errors"].append(repr(e))

    t_start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(i, client) for i in range(clients)))
    stats["wall_s"] = time.perf_counter() - t_start
    return stats


def scrape_totals(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    keep = (
        "kvtier:prefix_cache_queries_total",
        "kvtier:prefix_cache_hits_total",
        "kvtier:num_preemptions_total",
        "kvtier:recomputed_tokens_total",
        "kvtier:request_success_total",
        "kvtier:time_to_first_token_seconds_count",
    )
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name in keep:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def default_serve_flags(clients: int) -> list[str]:
    import torch

    flags = ["--num-device-blocks", "1024", "--max-num-seqs", str(min(clients, 64))]
    if not torch.cuda.is_available():
        flags += ["--dtype", "float32"]  # bfloat16 matmuls are several times slower on CPUs
    return flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--url", default=None, help="a running server (loopback only) instead of starting one")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_flags", nargs="*", help="extra `kvtier serve` flags (after --)")
    args = ap.parse_args()
    if not 1 <= args.clients <= 1024 or not 0 < args.duration_s <= 3600:
        raise SystemExit("--clients must be in [1, 1024] and --duration-s in (0, 3600]")

    import httpx

    proc = None
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-load-")
    if args.url:
        host = urlparse(args.url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit(f"--url must be a loopback address, got {host!r}")
        url = args.url.rstrip("/")
        wait_healthy(url, None, timeout_s=30)
    else:
        from kvtier.demo import ensure_demo_model

        model = args.model or str(ensure_demo_model(Path(tmp.name) / "model"))
        flags = args.serve_flags or default_serve_flags(args.clients)
        proc, url = start_server(model, flags, Path(tmp.name) / "serve.log")
    try:
        wait_healthy(url, proc)
        rss_before = rss_bytes(proc.pid if proc else None)
        stats = asyncio.run(run_clients(url, args.clients, args.duration_s, args.max_tokens, args.seed))
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/admin/check_integrity", timeout=120)
        integrity = {"status": r.status_code, **r.json(), "wait_s": time.perf_counter() - t0}
        rss_after = rss_bytes(proc.pid if proc else None)
        result = {
            "clients": args.clients,
            "duration_s": args.duration_s,
            "wall_s": stats["wall_s"],
            "requests": stats["requests"],
            "errors": len(stats["errors"]),
            "error_samples": stats["errors"][:5],
            "hung_up": stats["hung_up"],
            "client_ttft_p50_s": percentile(stats["client_ttft_s"], 0.5),
            "client_ttft_p95_s": percentile(stats["client_ttft_s"], 0.95),
            "engine_ttft_p50_s": percentile(stats["engine_ttft_s"], 0.5),
            "engine_ttft_p95_s": percentile(stats["engine_ttft_s"], 0.95),
            "output_tokens": stats["tokens"],
            "output_tokens_per_s": stats["tokens"] / stats["wall_s"],
            "cached_fraction": (stats["cached_tokens"] / stats["prompt_tokens"]) if stats["prompt_tokens"] else None,
            "server_rss_before_bytes": rss_before,
            "server_rss_after_bytes": rss_after,
            "integrity": integrity,
            "metrics": scrape_totals(url),
        }
        if stats["client_ttft_s"]:
            result["client_ttft_mean_s"] = statistics.fmean(stats["client_ttft_s"])
        print(json.dumps(result, indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()


if __name__ == "__main__":
    main()
