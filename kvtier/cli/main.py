"""The `kvtier` command: one module per subcommand under kvtier/cli/, each with `register(sub)`
(its subparser and flags) and `run(args) -> int` (its handler, set as the parser's `func`).

Every command that builds an engine takes the same engine and tier flags, added by
`add_engine_args` and turned into `LLM(...)` keyword arguments by `engine_kwargs`
(kvtier/cli/engine_args.py); a flag that is not given is left out, so the LLM constructor's
defaults apply.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvtier.cli import analyze, bench, cache, convert, demo, eval_kv, generate, serve, simulate
from kvtier.cli.args import parse_size
from kvtier.cli.engine_args import ENGINE_KEYS, KV_CACHE_DTYPES, TIER_KEYS, add_engine_args, engine_kwargs
from kvtier.threads.wait import apply_wait_policy
from kvtier.vllm_flags import check_vllm_flags

# re-exported: tests (and older callers) import these from here
__all__ = [
    "ENGINE_KEYS",
    "KV_CACHE_DTYPES",
    "TIER_KEYS",
    "_Parser",
    "add_engine_args",
    "build_parser",
    "engine_kwargs",
    "main",
    "parse_size",
]

COMMANDS = (demo, generate, convert, serve, analyze, simulate, bench, eval_kv, cache)
"""The subcommands, in the order `kvtier --help` lists them."""


class _Parser(argparse.ArgumentParser):
    """Reports every usage error as `kvtier: error: ...` (exit 2), subcommands included. No
    abbreviated flags: `--api-key` must never be taken for `--api-keys`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        # one line: what is wrong, and where the flags are listed (no usage block to scroll past)
        self.exit(2, f"kvtier: error: {message} (`{self.prog} --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="KV-cache-centric LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # before any subcommand imports torch: libgomp reads its barrier wait policy when torch loads
    # it (this process and the ones it starts, `kvtier serve`'s engine process among them)
    apply_wait_policy()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.engine_kwargs = engine_kwargs(args, args.subparser)
    try:
        if hasattr(args, "vllm_tensor_parallel_size"):  # the commands that take the engine flags
            for note in check_vllm_flags(args):
                print(f"kvtier: {note}", file=sys.stderr)
        return args.func(args)
    except (ValueError, OSError, ImportError) as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything else, e.g. a checkpoint kvtier cannot read: one line too
        if os.environ.get("KVTIER_DEBUG"):
            raise
        print(f"kvtier: error: {type(e).__name__}: {e} (KVTIER_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
