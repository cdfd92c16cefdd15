"""The online KV drift monitor on a short served run: one `kvtier serve` per KV dtype with
`--kv-drift-sample-rate`, long prompts from a text file, then the kvtier:kv_drift_* series
scraped from /metrics. Prints JSON (one object per KV dtype).

    python benchmarks/kv_drift_served.py --model /tmp/kvtier-trained --text /tmp/kvtier-trained/eval.txt

Prompts: --num-requests slices of the text, each --prompt-tokens long (starting at
consecutive offsets), greedy, --max-tokens each, sent --concurrency at a time; the same for every
KV dtype. With sample rate 1 every request is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvtier from this checkout

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name.startswith("kvtier:kv_drift") and set(s.labels) <= {"model_name"}:
                out[s.name.removeprefix("kvtier:")] = s.value
    return out


def run_one(args: argparse.Namespace, kv_dtype: str, prompts: list[list[int]]) -> dict:
    import httpx

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--dtype",
        args.dtype,
        "--kv-cache-dtype",
        kv_dtype,
        "--kv-drift-sample-rate",
        str(args.sample_rate),
        "--log-level",
        "warning",
        "--num-device-blocks",
        str(args.num_device_blocks),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited: {proc.stderr.read().decode(errors='replace')}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvtier serve did not start")
            time.sleep(0.2)

        def send(prompt: list[int]) -> list[int]:
            r = httpx.post(
                f"{url}/v1/completions",
                timeout=600,
                json={
                    "model": "m",
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            completion_tokens = sum(pool.map(send, prompts))
        wall_s = time.perf_counter() - t0
        m = _scrape(url)
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "kv_cache_dtype": kv_dtype,
        "requests": len(prompts),
        "completion_tokens": completion_tokens,
        "wall_s": round(wall_s, 1),
        **{k: round(v, 9) for k, v in sorted(m.items())},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/tmp/kvtier-trained")
    p.add_argument("--text", default=None, help="default: MODEL/eval.txt")
    p.add_argument("--kv-dtypes", default="fp8_e4m3,fp8_e5m2,int8,bfloat16,auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-device-blocks", type=int, default=2048)
    args = p.parse_args(argv)

    from kvtier.model.tokenizer import Tokenizer

    text = Path(args.text or Path(args.model) / "eval.txt").read_text()
    tokens = Tokenizer(args.model).encode(text)
    stride = max(1, (len(tokens) - args.prompt_tokens) // max(1, args.num_requests))
    prompts = [tokens[i * stride : i * stride + args.prompt_tokens] for i in range(args.num_requests)]
    results = [run_one(args, kv, prompts) for kv in args.kv_dtypes.split(",")]
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "sample_rate": args.sample_rate,
                "num_requests": args.num_requests,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
