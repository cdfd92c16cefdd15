"""`kvtier bench`: the subcommand; its flags and handler live in kvtier/bench/cli.py."""

from __future__ import annotations

import argparse

from kvtier.cli.engine_args import add_engine_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvtier.bench.cli import DESCRIPTION as BENCH_DESCRIPTION
    from kvtier.bench.cli import add_bench_args

    b = sub.add_parser(
        "bench",
        help="benchmark kvtier or any OpenAI-compatible server with cache-heavy workloads",
        description=BENCH_DESCRIPTION,
    )
    add_bench_args(b)
    add_engine_args(b)
    b.set_defaults(func=run, subparser=b)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.cli import run_bench

    return run_bench(args)
