"""A fleet of `kvtier serve` instances behind vllm-router, replaying a slice of a Mooncake trace,
once per routing policy, each from cold caches:

    round_robin    no cache knowledge
    cache_aware    vllm-router's approximate prefix tree of the text it routed (no engine state)
    kv_aware       vllm-router's index of the instances' KV events (kvtier --kv-events-config)

optionally each again with a shared Redis tier (`--redis`: every instance stores to and restores
from one redis-server, so a prefix computed on one instance is a hit on another).

    python benchmarks/fleet.py --out /tmp/fleet.json
    python benchmarks/fleet.py --requests 200 --policies round_robin,kv_aware --rate-scale 4

Trace: `hash_ids` (one per 512 tokens in the trace) are mapped to `--tokens-per-id` real tokens
each (the same tokens for the same id), so a 2-core machine can replay it; the block size is
set to the same number, so one hash id is one KV block. The model is a small random Llama with a
word-level tokenizer (id i <-> "w{i}": text round-trips to the same ids, so the router, which
tokenizes prompts through the instance's /tokenize, sees the ids the instance caches). Each
request: its trace arrival time divided by `--rate-scale`, `--max-tokens` output tokens
(greedy, ignore_eos), streamed. Figures per policy: the fleet prefix-hit rate (cached prompt
tokens / prompt tokens, from each response's usage, by tier: device, host, remote; `remote` is
what came from another instance through Redis), TTFT p50/p95, ITL p50, errors, requests per
instance, and the machine's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from kvtier.bench.server import free_port, start_redis_server, stop_process  # noqa: E402
from kvtier.trace import read_trace  # noqa: E402

TRACE = HERE.parent.parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"
MODEL_DIR = Path("/tmp/kvtier-fleet-model")
SMALL_MODEL = dict(
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=768,
    vocab_size=4096,
    max_position_embeddings=8192,
)


def ensure_model(out: Path) -> Path:
    """The small random Llama with the word-level tokenizer (built once)."""
    from serve_bench import add_word_tokenizer

    from kvtier.model.builder import build_random_llama

    raw = out.with_name(out.name + "-weights")
    if not (raw / "model.safetensors").is_file():
        build_random_llama(raw, seed=0, dtype="float32", **SMALL_MODEL)
    if not (out / "tokenizer.json").is_file():
        add_word_tokenizer(raw, out)
    return out


def trace_prompts(path: Path, start: int, n: int, tokens_per_id: int, vocab: int) -> list[tuple[float, str, int]]:
    """(arrival s, prompt text, output tokens in the trace) per request of the slice."""
    records = read_trace(path, limit=start + n)[start:]
    if not records:
        raise ValueError(f"no requests in {path} from {start}")
    t0 = records[0].time_ms
    out = []
    for r in records:
        words = []
        for h in r.hash_ids:
            rng = random.Random(h)
            words += [f"w{rng.randrange(3, vocab)}" for _ in range(tokens_per_id)]
        out.append(((r.time_ms - t0) / 1000.0, " ".join(words), r.output_length or 1))
    return out


class Fleet:
    """N instances (+ Redis) and a router, started for one policy and torn down after."""

    def __init__(self, args: argparse.Namespace, policy: str, redis: bool, tmp: Path) -> None:
        self.args, self.policy, self.redis, self.tmp = args, policy, redis, tmp
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.events: list[tuple[int, int]] = []
        self.router_url = ""
        self.router_metrics_url = ""
        self.redis_proc: subprocess.Popen | None = None

    def start(self) -> None:
        a = self.args
        remote: list[str] = []
        if self.redis:
            self.redis_proc, port = start_redis_server(self.tmp)
            remote = ["--remote-cache-url", f"redis://127.0.0.1:{port}"]
        for i in range(a.instances):
            port, ev, replay = free_port(), free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{ev}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            cmd = [
                sys.executable,
                "-m",
                "kvtier",
                "serve",
                str(a.model_dir),
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--block-size",
                str(a.tokens_per_id),
                "--num-device-blocks",
                str(a.pool_blocks),
                "--num-threads",
                str(a.threads),
                "--kv-events-config",
                json.dumps(config),
                "--max-model-len",
                "8192",
                *remote,
            ]
            log = open(self.tmp / f"instance{i}-{self.policy}.log", "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.events.append((ev, replay))
        for url, proc in zip(self.urls, self.procs):
            _wait(url + "/health", proc)
        rport = free_port()
        cmd = [
            "vllm-router",
            "--host",
            "127.0.0.1",
            "--port",
            str(rport),
            "--policy",
            self.policy,
            "--worker-urls",
            *self.urls,
            "--worker-startup-check-interval",
            "1",
            "--prometheus-port",
            str(prom := free_port()),
            "--log-level",
            "warning",
        ]
        if self.policy == "kv_aware":
            for url, (ev, replay) in zip(self.urls, self.events):
                cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}"]
                cmd += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]
            cmd += ["--kv-event-block-size", str(a.tokens_per_id), "--kv-event-model", str(a.model_dir)]
        cmd += self.args.router_arg
        self.router_metrics_url = f"http://127.0.0.1:{prom}/metrics"
        log = open(self.tmp / f"router-{self.policy}.log", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        self.router_url = f"http://127.0.0.1:{rport}"
        _wait(self.router_url + "/health", self.procs[-1])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)
        if self.redis_proc is not None:
            stop_process(self.redis_proc)


ROUTER_SERIES = (
    "vllm_router_policy_decisions_total",
    "vllm_router_kv_placement_lookups_total",
    "vllm_router_kv_routing_inputs_total",
    "vllm_router_cache_hits_total",
    "vllm_router_cache_misses_total",
    "vllm_router_load_balancing_events_total",
)


def router_decisions(url: str) -> dict[str, float]:
    """The router's own counts of how it decided (its Prometheus series, by label set)."""
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(ROUTER_SERIES):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] | None = None
    text, replica = "", None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            replica = r.headers.get("x-kvtier-replica")  # kvtier on Ray Serve names the replica
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    code = json.loads(raw)["error"].get("code")
                except (ValueError, KeyError, TypeError, AttributeError):
                    code = None
                return {"error": f"HTTP {r.status_code}: {raw[:200]!r}", "code": code, "sent": t0, "text": ""}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):  # an SSE error event: the stream ends here
                    err = chunk["error"]
                    return {"error": str(err.get("message")), "code": err.get("code"), "sent": t0, "text": text}
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter() - t0)
                    text += chunk["choices"][0]["text"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as e:
        return {"error": repr(e), "code": None, "sent": t0, "text": text}
    if not times or usage is None:
        return {"error": "no tokens or no usage", "code": None, "sent": t0, "text": text}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": times[0],
        "itl": [b - a for a, b in itertools.pairwise(times)],
        "prompt_tokens": usage["prompt_tokens"],
        "cached": details.get("cached_tokens") or 0,
        "by_tier": details.get("cached_tokens_by_tier") or {},
        "replica": replica,
        "sent": t0,
        "text": text,
    }


async def replay(url: str, model: str, prompts: list[tuple[float, str, int]], args: argparse.Namespace) -> list[dict]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def at(t: float, prompt: str, out_len: int) -> dict[str, Any]:
            delay = t / args.rate_scale - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            return await _one(client, url, model, prompt, min(out_len, args.max_tokens) or 1)

        return list(await asyncio.gather(*(at(t, p, o) for t, p, o in prompts)))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def reference_texts(model_dir: Path, prompts: list[tuple[float, str, int]], max_tokens: int) -> list[str]:
    """Each prompt's greedy output from kvtier's engine in this process, one request at a time
    (the replay's max_tokens for it, ignore_eos): what every instance must answer."""
    from kvtier import LLM, SamplingParams

    out = []
    with LLM(str(model_dir), dtype="float32", num_threads=1, max_model_len=8192) as llm:
        for _, prompt, out_len in prompts:
            params = SamplingParams(max_tokens=min(out_len, max_tokens) or 1, temperature=0.0, ignore_eos=True)
            out.append(llm.generate([prompt], params)[0].outputs[0].text)
    return out


def check_outputs(results: list[dict], reference: list[str]) -> dict[str, int]:
    """Completed requests whose text differs from the reference, and failed ones whose partial
    text is not a prefix of it (wrong tokens before the error)."""
    wrong = sum(1 for r, ref in zip(results, reference) if "error" not in r and r["text"] != ref)
    wrong_partial = sum(
        1 for r, ref in zip(results, reference) if "error" in r and r.get("text") and not ref.startswith(r["text"])
    )
    return {"checked": len(reference), "wrong_outputs": wrong, "wrong_partial_outputs": wrong_partial}


def summarize(results: list[dict], seconds: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    by_tier: dict[str, int] = {}
    for r in ok:
        for tier, n in r["by_tier"].items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_examples": [r["error"] for r in results if "error" in r][:3],
        "error_codes": dict(collections.Counter(str(r.get("code")) for r in results if "error" in r)),
        "prompt_tokens": prompt,
        "hit_rate": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else None,
        "hit_rate_by_tier": {t: round(n / prompt, 4) for t, n in sorted(by_tier.items())} if prompt else {},
        "ttft_p50_ms": round(1000 * _pct(ttft, 0.5), 1) if ttft else None,
        "ttft_p95_ms": round(1000 * _pct(ttft, 0.95), 1) if ttft else None,
        "itl_p50_ms": round(1000 * _pct(itl, 0.5), 1) if itl else None,
        "seconds": round(seconds, 1),
    }


def plan(args: argparse.Namespace) -> tuple[list, list[str] | None, list[tuple[str, bool]], dict[str, Any]]:
    """What a replay run needs from its arguments: the slice's prompts, the reference outputs
    (--check-tokens), the (policy, redis) variants and the report's head (machine, config, slice)."""
    ensure_model(args.model_dir)
    vocab = SMALL_MODEL["vocab_size"]
    prompts = trace_prompts(args.trace, args.start, args.requests, args.tokens_per_id, vocab)
    reference = reference_texts(args.model_dir, prompts, args.max_tokens) if args.check_tokens else None
    variants = [(p, False) for p in args.policies.split(",")]
    if args.redis:
        variants += [(p, True) for p in args.policies.split(",")]
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "slice": {
            "requests": len(prompts),
            "span_s": prompts[-1][0],
            "mean_prompt_words": statistics.mean(len(p.split()) for _, p, _ in prompts),
        },
        "runs": [],
    }
    return prompts, reference, variants, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--start", type=int, default=0, help="first request of the slice")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--tokens-per-id", type=int, default=8, help="tokens per trace hash id (= the block size)")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--pool-blocks", type=int, default=1500, help="device blocks per instance")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per instance")
    ap.add_argument("--policies", default="round_robin,cache_aware,kv_aware")
    ap.add_argument("--redis", action="store_true", help="also run every policy with a shared Redis tier")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="replay the trace this many times faster")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--check-tokens", action="store_true", help="compare every output with kvtier's own greedy output")
    ap.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="one more vllm-router argument (repeat; e.g. --router-arg=--router-temperature --router-arg=0.1)",
    )
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    prompts, reference, variants, report = plan(args)
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-") as tmp:
        for policy, redis in variants:
            fleet = Fleet(args, policy, redis, Path(tmp))
            try:
                fleet.start()
                t0 = time.perf_counter()
                load0 = os.getloadavg()[0]
                results = asyncio.run(replay(fleet.router_url, str(args.model_dir), prompts, args))
                row = summarize(results, time.perf_counter() - t0)
                if reference is not None:
                    row.update(check_outputs(results, reference))
                row.update(policy=policy, redis=redis, load_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
                per_instance = []
                for url in fleet.urls:
                    m = httpx.get(url + "/metrics", timeout=10).text
                    per_instance.append(
                        sum(
                            float(line.rsplit(" ", 1)[1])
                            for line in m.splitlines()
                            if line.startswith("kvtier:request_success_total")
                        )
                    )
                row["requests_per_instance"] = per_instance
                row["router"] = router_decisions(fleet.router_metrics_url)
            finally:
                fleet.stop()
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
