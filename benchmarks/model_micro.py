"""Model-runner micro-benchmarks on the reference model (random weights); prints JSON.

    python benchmarks/model_micro.py [--model-dir /tmp/kvtier-ref] [--dtype bfloat16] [--hf]

Steps timed (median of --repeat runs after one warm-up):
  prefill_2048        one sequence, 2048 new tokens from position 0, logits for the last one
  chunk4_at_2048      one sequence, 4 new tokens after 2048 cached ones
  decode_16x300       16 sequences of ~300 cached tokens, one new token each
  decode_64x300       the same with 64 sequences
  hf_prefill_2048     (--hf) transformers' forward over the same 2048 tokens, same checkpoint
The checkpoint is built with kvtier.model.builder (no transformers needed) if absent.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from kvtier.model.builder import REFERENCE_MODEL, build_random_llama
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput


def _median_s(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    parser.add_argument("--model-dir", default="/tmp/kvtier-ref")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hf", action="store_true", help="also time transformers' forward (needs transformers)")
    args = parser.parse_args()

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        build_random_llama(model_dir, **REFERENCE_MODEL)
    rng = random.Random(0)
    runner = ModelRunner(model_dir, dtype=args.dtype, block_size=16, num_blocks=2048)
    bs, vocab = runner.block_size, runner.arch.vocab_size
    results: dict[str, object] = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
    }

    prompt = [rng.randrange(vocab) for _ in range(2048)]
    prefill = SchedulerOutput(seqs=[ScheduledSeq("p", prompt, 0, _blocks(0, 2048, bs), True)])
    results["prefill_2048_s"] = round(_median_s(lambda: runner.execute(prefill), args.repeat), 4)

    chunk = SchedulerOutput(seqs=[ScheduledSeq("p", prompt[:4], 2048, _blocks(0, 2052, bs), True)])
    results["chunk4_at_2048_ms"] = round(1000 * _median_s(lambda: runner.execute(chunk), 4 * args.repeat), 2)

    decode16 = _decode_step(runner, 16, 200, rng)
    results["decode_16x300_ms"] = round(1000 * _median_s(lambda: runner.execute(decode16), 4 * args.repeat), 2)
    decode64 = _decode_step(runner, 64, 600, rng)
    results["decode_64x300_ms"] = round(1000 * _median_s(lambda: runner.execute(decode64), 4 * args.repeat), 2)

    if args.hf:
        from transformers import AutoModelForCausalLM

        del runner
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype)).eval()
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf_s = _median_s(lambda: hf(ids), max(1, args.repeat // 2))
        results["hf_prefill_2048_s"] = round(hf_s, 4)
        results["prefill_speedup_vs_hf"] = round(hf_s / results["prefill_2048_s"], 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
