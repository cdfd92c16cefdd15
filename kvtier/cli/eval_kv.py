"""`kvtier eval-kv`: the accuracy cost of each KV cache dtype (perplexity, KL, top-1 agreement)."""

from __future__ import annotations

import argparse
import json
import sys

from kvtier.cli.args import int_list, positive_int
from kvtier.model.kv_names import KV_CACHE_DTYPES


def _kv_dtype_list(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [n for n in names if n not in KV_CACHE_DTYPES or n == "auto"]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"invalid KV dtype {bad[0] if bad else text!r} (choose from {', '.join(KV_CACHE_DTYPES[1:])})"
        )
    return names


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k = sub.add_parser(
        "eval-kv",
        help="accuracy cost of each KV cache dtype: perplexity, KL, top-1 agreement",
        description="Runs windows of a text through the model with each KV dtype and with "
        "full-precision KV, over context lengths. The last S tokens of each window are scored "
        "at every length L: the window's last L + 1 tokens run as one prefill of L - S tokens, "
        "then S teacher-forced decode steps that read every earlier token's KV from the paged "
        "cache. Prints perplexity, mean KL(full || KV dtype) and top-1 agreement per KV dtype "
        "and length.",
    )
    k.add_argument(
        "--model",
        required=True,
        help="Hugging Face model directory or .gguf file (use trained weights: drift on random weights means nothing)",
    )
    k.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    k.add_argument(
        "--kv-dtypes",
        type=_kv_dtype_list,
        default=None,
        metavar="D1,D2,...",
        help="KV dtypes to compare (default: every supported one but the reference)",
    )
    k.add_argument(
        "--context-lengths",
        type=int_list,
        default=(128, 256, 512, 1024, 2048),
        metavar="L1,L2,...",
        help="context lengths in tokens (default 128,256,512,1024,2048)",
    )
    k.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="model dtype; the reference KV is this dtype (default float32)",
    )
    k.add_argument(
        "--score-tokens",
        type=positive_int,
        default=64,
        help="scored decode positions per window and length (default 64)",
    )
    k.add_argument("--num-windows", type=positive_int, default=8, help="windows of the text (default 8)")
    k.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="tokens per KV block: quantized KV keeps one scale per block and KV head (default 16)",
    )
    k.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    k.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer directory (default: --model)")
    k.add_argument("--plot", default=None, metavar="FILE.png", help="write perplexity / KL / top-1 vs context length")
    k.add_argument(
        "--task-items",
        type=int,
        default=0,
        metavar="N",
        help="also score N generated in-context retrieval questions (multiple choice by "
        "log-likelihood, kvtier.eval.tasks) with each KV dtype and report accuracy (default 0: off)",
    )
    k.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    k.set_defaults(func=run, subparser=None)


def run(args: argparse.Namespace) -> int:
    from kvtier.eval.kv_drift import EvalKVConfig, evaluate_kv, format_table, plot

    cfg = EvalKVConfig(
        model=args.model,
        text=args.text,
        kv_dtypes=args.kv_dtypes,
        context_lengths=args.context_lengths,
        dtype=args.dtype,
        score_tokens=args.score_tokens,
        num_windows=args.num_windows,
        block_size=args.block_size,
        device=args.device,
        tokenizer=args.tokenizer,
    )
    result = evaluate_kv(cfg, log=lambda line: print(f"kvtier: {line}", file=sys.stderr))
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:
            print("kvtier: --plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        else:
            print(f"kvtier: wrote {args.plot}", file=sys.stderr)
    tasks = None
    if args.task_items > 0:
        from kvtier.eval.tasks import evaluate_tasks
        from kvtier.eval.tasks import format_table as format_tasks

        tasks = evaluate_tasks(
            args.model,
            list(result.config["kv_dtypes"]),
            num_items=args.task_items,
            dtype=args.dtype,
            block_size=args.block_size,
            log=lambda line: print(f"kvtier: task {line}", file=sys.stderr),
        )
    if args.json:
        print(json.dumps({**result.to_json(), **({"task": tasks.to_json()} if tasks else {})}))
    else:
        print(format_table(result))
        if tasks is not None:
            print()
            print(format_tasks(tasks))
    return 0
