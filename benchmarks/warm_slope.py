"""Warm TTFT against the length of the cached prefix, for two versions of kvtier in one sitting.

    python benchmarks/warm_slope.py                                   # this checkout only
    python benchmarks/warm_slope.py --trees /tmp/kvtier-old .         # an A/B, interleaved

For each length, a prefix of that many tokens is served once (into the prefix cache), then
revisited `--repeats` times with 4 new tokens each (max_tokens=1): wall clock around `generate`,
as compare.py's long_context workload. The slope of the medians (least squares, ms per 1,000
cached tokens) is what grows with the cached context: the attention of the new tokens over it and
any per-token bookkeeping. With `--trees`, each tree (a kvtier checkout, e.g. a `git worktree` of
an older commit) runs in its own process with that tree first on sys.path, rounds alternating
A, B, A, B, so that a drift of the machine's speed hits both alike. One JSON object is printed.
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
LENGTHS = (1024, 2048, 4096, 8186)
NEW_TOKENS = 4


def slope_ms_per_1k(lengths: list[int], ms: list[float]) -> float:
    """Least-squares slope of `ms` against `lengths`, per 1,000 tokens."""
    mx, my = statistics.fmean(lengths), statistics.fmean(ms)
    num = sum((x - mx) * (y - my) for x, y in zip(lengths, ms))
    den = sum((x - mx) ** 2 for x in lengths)
    return 1000 * num / den


def worker(model: str, lengths: list[int], repeats: int, seed: int) -> dict:
    sys.path.insert(0, str(HERE))
    import workloads as W

    from kvtier import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        block_size=16,
        num_device_blocks=2048,
        max_num_batched_tokens=2048,
        skip_tokenizer_init=True,
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(prompt: list[int]) -> float:
        t = time.perf_counter()
        llm.generate([prompt], sp)
        return time.perf_counter() - t

    timed(W.tokens(99, 2048))  # one-time setup, not the cache
    out = {}
    for i, n in enumerate(lengths):
        prefix = W.tokens(seed + i, n)
        timed(prefix)
        warm = [timed(prefix + W.tokens(seed + 50 + 10 * r + i, NEW_TOKENS)) * 1000 for r in range(repeats)]
        out[str(n)] = warm
    llm.check_integrity()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/kvtier-ref")
    ap.add_argument("--trees", nargs="+", default=[str(HERE.parent)], help="kvtier checkouts to compare")
    ap.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    ap.add_argument("--repeats", type=int, default=5, help="warm requests per length and round")
    ap.add_argument("--rounds", type=int, default=2, help="processes per tree, alternating between trees")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1000, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.lengths, args.repeats, args.seed)))
        return

    sys.path.insert(0, str(HERE))
    from build_reference_model import ensure_reference_model
    from machine import measure

    ensure_reference_model(args.model)
    machine = measure()
    warm: dict[str, dict[str, list[float]]] = {t: {str(n): [] for n in args.lengths} for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--repeats", str(args.repeats)]
            cmd += ["--seed", str(1000 + 100 * r), "--lengths", *map(str, args.lengths)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{tree}: worker failed:\n{proc.stderr[-3000:]}")
            for n, xs in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                warm[tree][n] += xs
            print(f"[warm_slope] round {r} {tree} done", file=sys.stderr, flush=True)
    report: dict = {"machine": machine, "loadavg_after": os.getloadavg(), "lengths": args.lengths, "trees": {}}
    for tree, per in warm.items():
        med = [statistics.median(per[str(n)]) for n in args.lengths]
        report["trees"][tree] = {
            "warm_ms_median": [round(m, 2) for m in med],
            "warm_ms_range": [[round(min(per[str(n)]), 2), round(max(per[str(n)]), 2)] for n in args.lengths],
            "ms_per_1k_cached": round(slope_ms_per_1k(args.lengths, med), 3),
        }
    if len(args.trees) == 2:
        a, b = (report["trees"][t]["ms_per_1k_cached"] for t in args.trees)
        report["slope_ratio_first_over_second"] = round(a / b, 3) if b else None
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
