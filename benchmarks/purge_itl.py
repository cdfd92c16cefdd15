"""Decode ITL of 8 running streams while an admin purges 10,000 stored blocks; prints JSON.

    python benchmarks/purge_itl.py [--blocks 10000] [--streams 8] [--max-tokens 1200]

A tiny random Llama (byte tokenizer, 4k context) is served with a disk tier and a Redis tier
(its own redis-server on a free loopback port). Tenant "victim" owns `--blocks` stored blocks
in both tiers: written straight into the disk directory (frames, manifest) and into Redis
(entries, owner set) between two starts of the server, so the purge has exactly that much to
delete. Then, twice:

    baseline   8 streaming completions of tenant "bench" (ignore_eos), no purge
    purge      the same 8 streams; once each has 16 tokens, DELETE /v1/cache?tenant=victim

ITL is measured by the client: the gaps between consecutive SSE chunks of each stream (one
token per chunk: `logprobs: 0` makes the server send a chunk for every step, even one whose
bytes do not complete a UTF-8 character yet). Reported: p50, p99 and the longest gap over all streams, the gaps that
overlap the purge, and how long the purge took.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvtier.bench.server import start, start_redis_server, stop_process  # noqa: E402

BLOCK_SIZE = 16
ADMIN, BENCH, VICTIM = "sk-ops", "sk-bench", "sk-victim"


def build_model(d: Path) -> None:
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    vocab = build_byte_tokenizer(d)
    build_random_llama(
        d,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        vocab_size=vocab,
        max_position_embeddings=4096,
        dtype="float32",
        bos_token_id=256,
        eos_token_id=257,
    )


def start_redis(d: Path) -> tuple[subprocess.Popen, str]:
    proc, port = start_redis_server(d)
    return proc, f"redis://127.0.0.1:{port}/0"


def populate(disk_dir: Path, redis_url: str, num_blocks: int, frame_bytes: int) -> None:
    """`num_blocks` entries of tenant "victim" in the disk tier and in Redis, as the tiers lay
    them out (the purge deletes by the owner's manifest / set; it never decodes a frame)."""
    import redis

    fp_dir = next(p for p in disk_dir.iterdir() if p.is_dir())
    oid = hashlib.sha256(b"victim").hexdigest()[:32]
    keys = [hashlib.sha256(f"victim-{i}".encode()).digest()[:16] for i in range(num_blocks)]
    payload = os.urandom(frame_bytes)
    now = time.time()
    for k in keys:
        sub = fp_dir / k.hex()[:2]
        sub.mkdir(exist_ok=True)
        (sub / f"{k.hex()}.kv").write_bytes(payload)
    (fp_dir / "owners").mkdir(exist_ok=True)
    with open(fp_dir / "owners" / f"{oid}.keys", "a") as f:
        f.write("".join(f"{k.hex()} {now:.3f}\n" for k in keys))
    r = redis.Redis.from_url(redis_url)
    prefix = f"kvtier:{fp_dir.name}:"
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.set(prefix + k.hex(), payload)
    pipe.sadd(prefix + "owner:" + oid, *[k.hex() for k in keys])
    pipe.execute()


def stream(url: str, prompt: str, max_tokens: int, ready: threading.Barrier, out: list[float]) -> None:
    import httpx

    body = {
        "model": "kvtier-bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }  # logprobs: one chunk per step
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=600, headers={"Authorization": f"Bearer {BENCH}"}
    ) as r:
        n = 0
        try:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out.append(time.perf_counter())
                    n += 1
                    if n == 16:
                        ready.wait()
        finally:
            if n < 16:  # a short stream (or an error) must not hold the others at the barrier
                ready.abort()


def run_streams(url: str, num_streams: int, max_tokens: int, purge: bool) -> dict:
    import httpx

    times: list[list[float]] = [[] for _ in range(num_streams)]
    window: list[float] = []
    answer: dict = {}

    def do_purge() -> None:
        t0 = time.perf_counter()
        r = httpx.delete(f"{url}/v1/cache?tenant=victim", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=600)
        window[:] = [t0, time.perf_counter()]
        answer.update(status=r.status_code, body=r.json())

    ready = threading.Barrier(num_streams + 1)
    threads = [
        threading.Thread(target=stream, args=(url, f"stream {i} " * 8, max_tokens, ready, times[i]))
        for i in range(num_streams)
    ]
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError("a stream ended before its 16th chunk; see the server log") from None
    if purge:
        do_purge()
    for t in threads:
        t.join()
    gaps = [b - a for ts in times for a, b in itertools.pairwise(ts)]
    res = {"num_gaps": len(gaps), **_pcts(gaps)}
    if purge:
        t0, t1 = window
        during = [b - a for ts in times for a, b in itertools.pairwise(ts) if b > t0 and a < t1]
        res["purge_s"] = round(t1 - t0, 3)
        res["during_purge"] = {"num_gaps": len(during), **_pcts(during)}
        res["purge_answer"] = answer
        res["streams_outlived_purge"] = all(ts and ts[-1] > t1 for ts in times)
    return res


def _pcts(gaps: list[float]) -> dict:
    if not gaps:
        return {}
    q = statistics.quantiles(gaps, n=100, method="inclusive")
    return {
        "itl_p50_ms": round(q[49] * 1e3, 2),
        "itl_p99_ms": round(q[98] * 1e3, 2),
        "itl_max_ms": round(max(gaps) * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=10_000)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1200)
    args = ap.parse_args()
    import httpx

    with tempfile.TemporaryDirectory(prefix="kvtier-purge-itl-") as tmp:
        d = Path(tmp)
        build_model(d / "model")
        rproc, redis_url = start_redis(d)
        keys = d / "keys.json"
        keys.write_text(
            json.dumps({"keys": {BENCH: "bench", VICTIM: "victim", ADMIN: {"tenant": "ops", "admin": True}}})
        )
        flags = [
            "--api-keys",
            str(keys),
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK_SIZE),
            "--num-device-blocks",
            "2048",
            "--disk-cache-dir",
            str(d / "disk"),
            "--remote-cache-url",
            redis_url,
        ]
        try:
            s = start(str(d / "model"), flags, d / "serve0.log")
            try:  # one victim request: creates the fingerprint directory; gives the frame size
                httpx.post(
                    f"{s.url}/v1/completions",
                    json={"model": "kvtier-bench", "prompt": "v" * 64, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {VICTIM}"},
                    timeout=120,
                ).raise_for_status()
                frame_bytes = 0
                for _ in range(400):
                    files = list((d / "disk").rglob("*.kv"))
                    if files:
                        frame_bytes = files[0].stat().st_size
                        break
                    time.sleep(0.05)
            finally:
                s.stop()
            populate(d / "disk", redis_url, args.blocks, frame_bytes)
            s = start(str(d / "model"), flags, d / "serve1.log")
            try:
                run_streams(s.url, args.streams, 64, purge=False)  # warm-up
                baseline = run_streams(s.url, args.streams, args.max_tokens, purge=False)
                purged = run_streams(s.url, args.streams, args.max_tokens, purge=True)
            finally:
                s.stop()
        finally:
            stop_process(rproc)
    load = os.getloadavg()
    print(
        json.dumps(
            {
                "blocks": args.blocks,
                "streams": args.streams,
                "max_tokens": args.max_tokens,
                "frame_bytes": frame_bytes,
                "cpus": os.cpu_count(),
                "loadavg_1m": round(load[0], 2),
                "baseline": baseline,
                "with_purge": purged,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
