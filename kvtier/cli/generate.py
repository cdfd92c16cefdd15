"""`kvtier generate`: text for prompts from a local checkpoint, printed to stdout."""

from __future__ import annotations

import argparse
import sys

from kvtier.cli.args import positive_int
from kvtier.cli.engine_args import add_engine_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("generate", help="generate text for prompts with a local checkpoint")
    g.add_argument("--model", required=True, help="Hugging Face model directory or .gguf file")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--max-tokens", type=positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--chat", action="store_true", help="each prompt is a user message, rendered with the model's chat template"
    )
    g.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
    g.add_argument(
        "-v", "--verbose", action="store_true", help="print cached tokens by tier, restore decision and TTFT to stderr"
    )
    add_engine_args(g)
    g.set_defaults(func=run, subparser=g)


def run(args: argparse.Namespace) -> int:
    from kvtier import LLM, SamplingParams

    with LLM(args.model, **args.engine_kwargs) as llm:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        if args.chat:
            if llm.tokenizer is None or not llm.tokenizer.chat_template:
                raise SystemExit(
                    f"kvtier generate: error: --chat needs a model with a chat template; {args.model} has none"
                )
            system = [{"role": "system", "content": args.system}] if args.system else []
            outputs = llm.chat([system + [{"role": "user", "content": prompt}] for prompt in args.prompt], sp)
        else:
            if args.system:
                raise SystemExit("kvtier generate: error: --system needs --chat")
            outputs = llm.generate(args.prompt, sp)
        for o in outputs:
            print(o.outputs[0].text)
            if args.verbose:
                ttft = o.metrics.ttft_s
                ttft_text = f"{ttft * 1e3:.1f} ms" if ttft is not None else "n/a"
                print(
                    f"[kvtier] prompt {len(o.prompt_token_ids)} tokens, cached {o.cached_tokens_by_tier}, "
                    f"computed {o.num_recomputed_tokens}, restore {o.restore_decision}, "
                    f"TTFT {ttft_text}",
                    file=sys.stderr,
                )
    return 0
