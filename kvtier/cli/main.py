"""The `kvtier` command."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from kvtier.demo import run_demo

    summary = run_demo(args.model_dir, prefix_repeats=args.prefix_repeats, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(summary))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvtier import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size,
              num_device_blocks=args.num_device_blocks, seed=args.seed)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    for o in llm.generate(args.prompt, sp):
        print(o.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="KV-cache-centric LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="shared-prefix workload on a built-in untrained model (no download)")
    d.add_argument("--model-dir", default=None, help="where to build/find the demo model "
                   "(default: $KVTIER_CACHE_DIR or ~/.cache/kvtier)")
    d.add_argument("--prefix-repeats", type=int, default=12, help="length of the shared system prompt")
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--json", action="store_true", help="also print the summary as JSON")
    d.set_defaults(func=_demo)

    g = sub.add_parser("generate", help="generate text for prompts with a local checkpoint")
    g.add_argument("--model", required=True, help="Hugging Face model directory")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-device-blocks", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
