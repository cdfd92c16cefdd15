"""Fairness under hostile requests: normal clients' TTFT alone vs while one client keeps sending
a request built to hold up the server; prints one JSON object.

    python benchmarks/fairness.py [--duration-s 10] [--clients 4] [--checkout DIR]
        [--max-concurrent-requests-per-key N] [--rate-limit-per-key RATE]

Starts `kvtier serve` (a tiny random float32 Llama with the byte-level tokenizer, a 65,536-token
context, 8 MiB bodies) from this checkout or --checkout DIR (to measure older code from a
`git worktree`). Four clients each stream one short completion at a time (TTFT: the first
streamed chunk). Scenarios, each --duration-s long, with one hostile client (its own process)
sending one request after another:

    alone        nobody else
    prompts      {"prompt": [[5,6,7]]*20000, "max_tokens": 1}
    text_3mb     a 3 MB text prompt (more characters than the context can hold)
    text_600kb   a 600 KB text prompt (passes the character bound; too long once tokenized)
    flood        32 senders on one key, each a 64-token completion after another

Every client sends its own API key (the hostile one too), so the server's per-key limits, when
the two flags pass them on (default: off, as the server's; the server then checks the keys,
--api-key), bound the hostile client alone.

JSON: per scenario, the clients' TTFT p50/p95 (ms) and their ratio to `alone`, and the hostile
requests' count, statuses and mean latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from kvtier.bench.server import free_port, stop_process  # noqa: E402

MODEL_NAME = "fairness"
MAX_MODEL_LEN = 65536

HOSTILE: dict[str, dict[str, Any] | None] = {
    "alone": None,
    "prompts": {"prompt": [[5, 6, 7]] * 20000, "max_tokens": 1},
    "text_3mb": {"prompt": "x" * (3 << 20), "max_tokens": 1},
    "text_600kb": {"prompt": "hello world " * (600_000 // 12), "max_tokens": 1},
    "flood": {"prompt": "flood " * 40, "max_tokens": 64, "ignore_eos": True},
}

PARALLEL = {"flood": 32}
"""Senders in the hostile process per scenario (one API key); 1 where not named."""


def build_model(out_dir: Path) -> None:
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    vocab = build_byte_tokenizer(out_dir)
    build_random_llama(
        out_dir,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=MAX_MODEL_LEN,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )


def start_server(
    model_dir: Path, checkout: Path, log_path: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--block-size",
        "16",
        "--num-device-blocks",
        "512",
        "--max-body-bytes",
        "8MiB",
        "--log-level",
        "warning",
        *extra,
    ]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtier serve exited:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_process(proc)
    raise RuntimeError("kvtier serve did not start")


async def normal_client(
    client: Any, i: int, stop_at: float, ttfts_s: list[float], errors: list[int] | None = None
) -> None:
    from kvtier.server.sse import aiter_events

    k = 0
    while time.monotonic() < stop_at:
        body = {
            "model": MODEL_NAME,
            "prompt": f"client {i} request {k}: tell me a story",
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        headers = {"Authorization": f"Bearer client-{i}"}
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            first = None
            async for event in aiter_events(r):
                if first is None and event is not None and event["choices"][0]["text"] is not None:
                    first = time.perf_counter() - t0
            if r.status_code == 200 and first is not None:
                ttfts_s.append(first)
            elif errors is not None:
                errors.append(r.status_code)
        k += 1


_HOSTILE_LOOP = """
import json, sys, threading, time, httpx
url, duration_s, path, parallel = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
body = open(path, "rb").read()
out = []
stop_at = time.monotonic() + duration_s

def loop():
    with httpx.Client(base_url=url, timeout=600) as c:
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            r = c.post(
                "/v1/completions",
                content=body,
                headers={"content-type": "application/json", "authorization": "Bearer hostile"},
            )
            out.append((r.status_code, time.perf_counter() - t0))

threads = [threading.Thread(target=loop) for _ in range(parallel)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out))
"""


async def hostile_client(
    url: str, body: bytes, duration_s: float, out: list[tuple[int, float]], parallel: int = 1
) -> None:
    """In its own process, as a hostile client would be: its JSON and HTTP work is not done on
    the normal clients' event loop; `parallel` senders (threads) share its one API key."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(body)
        f.flush()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _HOSTILE_LOOP,
            url,
            str(duration_s),
            f.name,
            str(parallel),
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await proc.communicate()
    out += [tuple(x) for x in json.loads(stdout)]


async def scenario(
    url: str, hostile: dict[str, Any] | None, clients: int, duration_s: float, parallel: int = 1
) -> dict[str, Any]:
    import httpx

    ttfts_s: list[float] = []
    hostile_out: list[tuple[int, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=32)) as client:
        stop_at = time.monotonic() + duration_s
        errors: list[int] = []
        tasks = [normal_client(client, i, stop_at, ttfts_s, errors) for i in range(clients)]
        if hostile is not None:
            body = json.dumps({"model": MODEL_NAME, **hostile}).encode()
            tasks.append(hostile_client(url, body, duration_s, hostile_out, parallel))
        await asyncio.gather(*tasks)
    q = statistics.quantiles(ttfts_s, n=20) if len(ttfts_s) >= 2 else [float("nan")] * 19
    res: dict[str, Any] = {
        "requests": len(ttfts_s),
        "errors": {str(c): errors.count(c) for c in sorted(set(errors))},
        "ttft_p50_ms": round(statistics.median(ttfts_s) * 1e3, 2),
        "ttft_p95_ms": round(q[18] * 1e3, 2),
        "ttft_max_ms": round(max(ttfts_s) * 1e3, 2),
    }
    if hostile is not None:
        res["hostile"] = {
            "requests": len(hostile_out),
            "statuses": {str(c): sum(1 for s, _ in hostile_out if s == c) for c in sorted({s for s, _ in hostile_out})},
            "mean_latency_s": round(statistics.mean(t for _, t in hostile_out), 3),
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--checkout", type=Path, default=REPO, help="the kvtier tree to serve (default: this one)")
    ap.add_argument(
        "--max-concurrent-requests-per-key",
        type=int,
        default=0,
        metavar="N",
        help="passed to `kvtier serve` (default 0: off)",
    )
    ap.add_argument(
        "--rate-limit-per-key", default="0", metavar="RATE", help="passed to `kvtier serve` (default 0: off)"
    )
    ap.add_argument("--only", default="", help="comma-separated scenario names (alone always runs)")
    args = ap.parse_args()
    limits: tuple[str, ...] = ()
    if args.max_concurrent_requests_per_key:
        limits += ("--max-concurrent-requests-per-key", str(args.max_concurrent_requests_per_key))
    if args.rate_limit_per_key != "0":
        limits += ("--rate-limit-per-key", args.rate_limit_per_key)
    if limits:  # the limits count keys only where the server checks them
        limits += ("--api-key", *(f"client-{i}" for i in range(args.clients)), "hostile")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir)
        proc, url = start_server(model_dir, args.checkout.resolve(), Path(tmp) / "serve.log", limits)
        try:
            asyncio.run(scenario(url, None, args.clients, 2.0))  # warm up
            results = {
                name: asyncio.run(scenario(url, body, args.clients, args.duration_s, PARALLEL.get(name, 1)))
                for name, body in HOSTILE.items()
                if not args.only or name == "alone" or name in args.only.split(",")
            }
        finally:
            stop_process(proc)
    base = results["alone"]
    for _name, r in results.items():
        r["ttft_p50_x_alone"] = round(r["ttft_p50_ms"] / base["ttft_p50_ms"], 2)
        r["ttft_p95_x_alone"] = round(r["ttft_p95_ms"] / base["ttft_p95_ms"], 2)
    print(
        json.dumps(
            {
                "checkout": str(args.checkout),
                "clients": args.clients,
                "duration_s": args.duration_s,
                "per_key_limits": list(limits),
                "cpus": os.cpu_count(),
                "loadavg": os.getloadavg(),
                "scenarios": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
