"""`kvtier analyze`: the traffic profile of a request log (reuse, intervals, shared segments)."""

from __future__ import annotations

import argparse
import json

from kvtier.cli.args import positive_int


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    a = sub.add_parser(
        "analyze",
        help="traffic profile of a request log: reuse, intervals, shared segments",
        description="Reads a kvtier request log, token-id lists, Mooncake trace records or "
        "OpenAI request bodies (with --tokenizer) and reports how much a prefix cache can "
        "reuse, how soon reuse comes back, where shared segments sit, with recommendations.",
    )
    a.add_argument("log", help="JSONL file")
    a.add_argument(
        "--block-tokens",
        type=positive_int,
        default=None,
        help="tokens per block (default 16; 512 for Mooncake records)",
    )
    a.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenize text requests with this model dir")
    a.add_argument(
        "--kv-bytes-per-token",
        type=positive_int,
        default=12 * 1024,
        help="for sizing advice (default 12 KiB, the reference model in bf16)",
    )
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=run, subparser=None)


def run(args: argparse.Namespace) -> int:
    from kvtier.sim.profile import analyze, format_text, parse_records, summary

    tok = None
    if args.tokenizer:
        from kvtier.model.tokenizer import Tokenizer

        tok = Tokenizer(args.tokenizer)
    with open(args.log, encoding="utf-8") as f:
        prof = analyze(parse_records(f, tok), block_tokens=args.block_tokens)
    s = summary(prof, block_bytes_per_token=args.kv_bytes_per_token)
    print(json.dumps(s, indent=1) if args.json else format_text(s))
    return 0
