"""Model-runner micro-benchmarks on the reference model (random weights); prints JSON.

    python benchmarks/model_micro.py [--model-dir /tmp/kvtier-ref] [--dtype bfloat16] [--hf]

Steps timed after one warm-up; each reports the min and the median of its runs (the min is the
figure to quote on a shared machine, where other processes inflate single runs):
  prefill_2048        one sequence, 2048 new tokens from position 0, logits for the last one
  chunk4_at_2048      one sequence, 4 new tokens after 2048 cached ones
  decode_16x300       16 sequences of ~300 cached tokens, one new token each
  decode_64x300       the same with 64 sequences
  hf_prefill_2048     (--hf) transformers' forward over the same 2048 tokens, same checkpoint
The checkpoint is built with kvtier.model.builder (no transformers needed) if absent.
On a shared machine quote the min and the ratio measured in one run; other processes inflate
medians (and stall torch's OpenMP threads) unpredictably.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_reference_model import DEFAULT_DIR, ensure_reference_model
from machine import describe

from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput


def _time_ms(*fns, repeat: int) -> list[dict[str, float]]:
    """Time each of `fns`, interleaved (so that load from other processes hits all alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(repeat):
        for fn, fn_times in zip(fns, times):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return [{"min_ms": round(1000 * min(t), 2), "median_ms": round(1000 * statistics.median(t), 2)} for t in times]


def _blocks(first: int, num_tokens: int, block_size: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // block_size)))


def _decode_step(runner: ModelRunner, num_seqs: int, first_block: int, rng: random.Random) -> SchedulerOutput:
    """Prefill `num_seqs` sequences of ~300 tokens, return the decode step that follows them."""
    bs, vocab = runner.block_size, runner.arch.vocab_size
    seqs, block = [], first_block
    for i in range(num_seqs):
        n = rng.randint(280, 320)
        table = _blocks(block, n + 1, bs)
        block += len(table)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        runner.execute(SchedulerOutput(seqs=[ScheduledSeq(f"r{i}", prompt, 0, table, True)]))
        seqs.append(ScheduledSeq(f"r{i}", [rng.randrange(vocab)], n, table, True))
    return SchedulerOutput(seqs=seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=DEFAULT_DIR)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hf", action="store_true", help="also time transformers' forward (needs transformers)")
    parser.add_argument("--no-pack", action="store_true", help="do not pre-pack weights for oneDNN")
    args = parser.parse_args()

    model_dir = ensure_reference_model(args.model_dir)
    rng = random.Random(0)
    runner = ModelRunner(model_dir, dtype=args.dtype, block_size=16, num_blocks=2048, pack_weights=not args.no_pack)
    bs, vocab = runner.block_size, runner.arch.vocab_size
    results: dict[str, object] = {
        "machine": describe(),
        "dtype": args.dtype,
        "packed_weights": not args.no_pack,
    }

    prompt = [rng.randrange(vocab) for _ in range(2048)]
    prefill = SchedulerOutput(seqs=[ScheduledSeq("p", prompt, 0, _blocks(0, 2048, bs), True)])
    if args.hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype)).eval()
        ids = torch.tensor([prompt])

        def hf_forward() -> None:
            with torch.inference_mode():
                hf(ids)

        ours, theirs = _time_ms(lambda: runner.execute(prefill), hf_forward, repeat=args.repeat)
        results |= {"prefill_2048": ours, "hf_prefill_2048": theirs}
        results["prefill_speedup_vs_hf"] = round(theirs["min_ms"] / ours["min_ms"], 2)
        del hf
    else:
        [results["prefill_2048"]] = _time_ms(lambda: runner.execute(prefill), repeat=args.repeat)

    chunk = SchedulerOutput(seqs=[ScheduledSeq("p", prompt[:4], 2048, _blocks(0, 2052, bs), True)])
    [results["chunk4_at_2048"]] = _time_ms(lambda: runner.execute(chunk), repeat=10 * args.repeat)

    decode16 = _decode_step(runner, 16, 200, rng)
    [results["decode_16x300"]] = _time_ms(lambda: runner.execute(decode16), repeat=10 * args.repeat)
    decode64 = _decode_step(runner, 64, 600, rng)
    [results["decode_64x300"]] = _time_ms(lambda: runner.execute(decode64), repeat=10 * args.repeat)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
