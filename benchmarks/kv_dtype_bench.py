"""Quantized KV cache on the reference model; prints one JSON object.

    python benchmarks/kv_dtype_bench.py [--model /tmp/kvtier-ref] [--repeats 3]

1. Decode throughput per kv_cache_dtype (auto = bfloat16, fp8_e4m3, fp8_e5m2, int8, int8_tok): 16 sequences
   with 1024-token prompts, 128 output tokens each (greedy, ignore_eos). One engine per dtype, all
   in this process, and the repeats interleave the dtypes so that they share the machine's noise.
   A warm-up run prefills the prompts; each measured run hits them in the device prefix cache, so
   the timed part is the decode: from every sequence having its first token to the last token.
   Ratios against bfloat16 are taken within each repeat; the medians are reported.
2. Tokens one GiB of KV pool holds, per dtype (scales included).
3. TTFT of a 2048-token prefix (+ 4 new tokens) restored from the host tier, each 1-byte dtype
   vs bfloat16, with the bytes moved and the restore time.

--model takes any checkpoint (a GGUF file too: SmolLM2-135M-Instruct for real-model figures);
prompts are token ids below 32,000.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import workloads as W  # noqa: E402
from build_reference_model import ensure_reference_model  # noqa: E402
from machine import describe  # noqa: E402

BS = 16
DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int8_tok"]
"""The dtypes measured (--dtypes); "auto" (the model dtype, bfloat16) is the baseline of the ratios."""


def llm(model: str, kv_cache_dtype: str, **kw):
    from kvtier import LLM

    args = dict(
        dtype="bfloat16",
        block_size=BS,
        skip_tokenizer_init=True,
        restore_policy="always",
        kv_cache_dtype=kv_cache_dtype,
    )
    args.update(kw)
    return LLM(model, **args)


def decode_run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds from every sequence's first token to the last token, decode tokens)."""
    from kvtier import SamplingParams

    core = engine.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        core.add_request(p, sp)
    while any(not r.output_token_ids for r in core.scheduler.requests.values()):
        core.step()
    t0 = time.perf_counter()
    while core.has_unfinished:
        core.step()
    return time.perf_counter() - t0, len(prompts) * (max_tokens - 1)


def decode_throughput(model: str, repeats: int, num_seqs: int, context: int, max_tokens: int) -> dict:
    prompts = [W.tokens(1000 + i, context) for i in range(num_seqs)]
    num_blocks = num_seqs * (-(-(context + max_tokens) // BS)) * 2 + 8  # prompts + outputs, twice over
    engines = {name: llm(model, name, num_device_blocks=num_blocks, max_num_seqs=num_seqs) for name in DTYPES}
    for e in engines.values():
        decode_run(e, prompts, 4)  # prefill the prompts once, compile, warm caches
    tok_s: dict[str, list[float]] = {name: [] for name in DTYPES}
    for _ in range(repeats):
        for name, e in engines.items():
            dt, n = decode_run(e, prompts, max_tokens)
            tok_s[name].append(n / dt)
    out = {}
    for name in DTYPES:
        ratios = [a / b for a, b in zip(tok_s[name], tok_s["auto"])]
        out[name] = {
            "decode_tok_s": round(statistics.median(tok_s[name]), 1),
            "runs_tok_s": [round(x, 1) for x in tok_s[name]],
            "vs_bf16": round(statistics.median(ratios), 3),
            "kv_bytes_per_block": engines[name].engine.runner.kv_bytes_per_block,
        }
    for e in engines.values():
        e.close()
    return out


def tokens_per_gib(model: str) -> dict:
    out = {}
    for name in DTYPES:
        e = llm(model, name, kv_cache_bytes=1 << 30)
        r = e.engine.runner
        out[name] = {
            "tokens_per_gib": r.num_blocks * BS,
            "kv_bytes_per_token": round(r.kv_bytes_per_token, 2),
            "pool_bytes": r.kv_pool.nbytes + (r.kv_scales.nbytes if r.kv_scales is not None else 0),
        }
        e.close()
    base = out["auto"]["tokens_per_gib"]
    for v in out.values():
        v["vs_bf16"] = round(v["tokens_per_gib"] / base, 3)
    return out


def host_restore_ttft(model: str, repeats: int) -> dict:
    from kvtier import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    res: dict[str, dict] = {}
    engines = {
        name: llm(model, name, num_device_blocks=1024, host_cache_bytes=2 << 30)
        for name in DTYPES
        if name in ("auto", "fp8_e4m3", "int8_tok")
    }
    for e in engines.values():
        e.generate([W.tokens(99, 2048)], sp)  # warm: kernels, compile, calibration
    ttft: dict[str, list] = {name: [] for name in engines}
    restore: dict[str, list] = {name: [] for name in engines}
    cached: dict[str, list] = {name: [] for name in engines}
    for r in range(repeats):
        prefix = W.tokens(300 + r, 2048)
        for name, e in engines.items():
            e.generate([prefix + W.tokens(400 + r, 16)], sp)  # computed, written through to host
            e.engine.reset_prefix_cache()
            out = e.generate([prefix + W.tokens(500 + r, 4)], sp)[0]
            ttft[name].append(out.metrics.ttft_s)
            restore[name].append(out.restore_s)
            cached[name].append(out.cached_tokens_by_tier.get("host", 0))
    for name, e in engines.items():
        block_bytes = e.engine.runner.kv_bytes_per_block
        host_tokens = statistics.median(cached[name])
        res[name] = {
            "ttft_ms": round(statistics.median(ttft[name]) * 1e3, 1),
            "runs_ttft_ms": [round(x * 1e3, 1) for x in ttft[name]],
            "restore_ms": round(statistics.median(restore[name]) * 1e3, 2),
            "host_tokens": host_tokens,
            "bytes_moved": int(host_tokens // BS * block_bytes),
        }
        e.close()
    for name in list(res):
        if name == "auto":
            continue
        res[f"{name}_vs_bf16"] = {
            "ttft": round(res[name]["ttft_ms"] / res["auto"]["ttft_ms"], 3),
            "restore": round(res[name]["restore_ms"] / res["auto"]["restore_ms"], 3),
            "bytes_moved": round(res[name]["bytes_moved"] / res["auto"]["bytes_moved"], 3),
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/kvtier-ref")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--dtypes", default=None, help="comma-separated KV dtypes (default: " + ",".join(DTYPES) + ")")
    args = ap.parse_args()
    if args.dtypes:
        DTYPES[:] = ["auto", *[d for d in args.dtypes.split(",") if d != "auto"]]
    model = args.model if Path(args.model).is_file() else str(ensure_reference_model(args.model))
    result = {"machine": describe(), "tokens_per_gib": tokens_per_gib(model)}
    result["host_restore_2048"] = host_restore_ttft(model, args.repeats)
    if not args.skip_decode:
        result["decode"] = decode_throughput(model, args.repeats, args.num_seqs, args.context, args.max_tokens)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
