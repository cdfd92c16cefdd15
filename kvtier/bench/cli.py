"""The flags of `kvtier bench` and its handler (kvtier/cli/bench.py adds the subcommand).

Importing this module is light (no torch, no httpx): `kvtier --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from kvtier.bench.runner import SCENARIOS, BenchConfig, run
from kvtier.bench.workloads import WORKLOADS, WorkloadConfig
from kvtier.cli.args import positive_int, size  # the types of the engine flags

DESCRIPTION = """\
Benchmarks an OpenAI-compatible server with cache-heavy workloads: kvtier itself (--model: the
harness starts `kvtier serve` with the engine and tier flags below) or any server (--url: kvtier,
vLLM, SGLang, measured the same way). Streams every completion, records TTFT, inter-token latency,
end-to-end latency and cached tokens (by tier where reported) per request, scrapes /metrics
before and after, and writes JSON, Markdown and PNG plots under --out."""


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    v = _nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be positive, got 0")
    return v


def _int_list(text: str) -> tuple[int, ...]:
    out = tuple(positive_int(p.strip()) for p in text.split(",") if p.strip())
    if not out:
        raise argparse.ArgumentTypeError("give comma-separated integers, e.g. 1,2,4,8")
    return out


def _key_pair(text: str) -> tuple[str, str]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise argparse.ArgumentTypeError("give two different API keys: KEY_A,KEY_B")
    return parts[0], parts[1]


def add_bench_args(p: argparse.ArgumentParser) -> None:

    t = p.add_argument_group("target")
    target = t.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="start `kvtier serve` on this checkpoint (engine and tier flags below apply)",
    )
    target.add_argument(
        "--url",
        default=None,
        help="benchmark a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 (kvtier, vLLM, SGLang)",
    )
    t.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the `model` field sent (default: the first id of /v1/models)",
    )
    t.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    t.add_argument(
        "--tenant-keys",
        type=_key_pair,
        default=None,
        metavar="KEY_A,KEY_B",
        help="two keys of different tenants, for --scenario isolation with --url",
    )

    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="shared_prefix",
        help="shared_prefix: groups sharing a system prompt; multi_turn: chats with growing "
        "context and think time; agent: shared tool definitions, flows that branch; rag: "
        "instructions + documents from a pool; independent: short unrelated prompts; mixed: "
        "multi_turn + independent; trace: Mooncake trace replay (default shared_prefix)",
    )
    w.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="run",
        help="run: once; concurrency: at each --concurrency-sweep; host_full: roomy vs small "
        "host tier; slow_storage: without vs with --tier-faults; mixed: long sessions + short "
        "prompts; isolation: two tenants, same prompts, cross-tenant cached tokens must be 0",
    )
    w.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts and arrivals (default 0)")
    w.add_argument(
        "--vocab-size",
        type=positive_int,
        default=32000,
        help="synthetic token ids are drawn below this (default 32000)",
    )
    w.add_argument("--output-tokens", type=positive_int, default=16, help="max_tokens per request (default 16)")
    w.add_argument(
        "--rate",
        type=_positive_float,
        default=None,
        metavar="PER_S",
        help="Poisson session arrivals per second (default: all at once, paced by --concurrency)",
    )
    w.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="sessions in flight at most (default 4; unlimited for trace and --rate)",
    )
    w.add_argument(
        "--concurrency-sweep",
        type=_int_list,
        default=(1, 2, 4, 8),
        metavar="N1,N2,...",
        help="the concurrency scenario's points (default 1,2,4,8)",
    )
    d = WorkloadConfig()
    for flag, kind, help_text in (
        ("num_groups", positive_int, "shared_prefix: groups"),
        ("prompts_per_group", positive_int, "shared_prefix: prompts per group"),
        ("system_tokens", positive_int, "shared_prefix / multi_turn: system prompt tokens"),
        ("question_tokens", positive_int, "shared_prefix / rag: question tokens"),
        ("num_sessions", positive_int, "multi_turn / agent: sessions (agent: flows)"),
        ("turns", positive_int, "multi_turn / agent: turns (steps) per session"),
        ("user_tokens", positive_int, "multi_turn: user tokens per turn (agent: task tokens)"),
        ("reply_tokens", positive_int, "multi_turn: synthesized assistant tokens per turn"),
        ("think_time_s", _nonneg_float, "multi_turn / agent: mean think time between turns (s)"),
        ("tool_tokens", positive_int, "agent: shared tool-definition tokens"),
        ("branches", positive_int, "agent: sessions each flow branches into"),
        ("shared_steps", int, "agent: steps the branches of a flow share"),
        ("step_tokens", positive_int, "agent: tokens appended per step"),
        ("doc_pool", positive_int, "rag: documents in the pool"),
        ("docs_per_request", positive_int, "rag: documents per request"),
        ("doc_tokens", positive_int, "rag: tokens per document"),
        ("instruction_tokens", positive_int, "rag: fixed instruction tokens"),
        ("num_requests", positive_int, "independent / rag / isolation: requests"),
        ("prompt_tokens", positive_int, "independent: prompt tokens"),
    ):
        w.add_argument(
            "--" + flag.replace("_", "-"),
            dest="wl_" + flag,
            type=kind,
            default=getattr(d, flag),
            metavar=flag.split("_")[-1].upper(),
            help=f"{help_text} (default {getattr(d, flag)})",
        )

    tr = p.add_argument_group("trace replay (--workload trace)")
    tr.add_argument(
        "--trace",
        default=None,
        metavar="FILE.jsonl",
        help="Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids",
    )
    tr.add_argument(
        "--block-tokens",
        type=positive_int,
        default=512,
        help="tokens synthesized per hash id (default 512; smaller scales the trace down, input lengths scaled alike)",
    )
    tr.add_argument(
        "--trace-block-tokens", type=positive_int, default=512, help="tokens per hash id in the trace (default 512)"
    )
    tr.add_argument("--speedup", type=_positive_float, default=1.0, help="divide arrival times by this (default 1)")
    tr.add_argument("--limit", type=positive_int, default=None, help="replay the first N records")
    tr.add_argument(
        "--trace-output-lengths", action="store_true", help="use the records' output_length (capped by --output-tokens)"
    )

    c = p.add_argument_group("client and output")
    c.add_argument(
        "--text-prompts",
        action="store_true",
        help="send text (one pseudo-word per synthetic token) instead of token ids",
    )
    c.add_argument(
        "--no-return-token-ids",
        dest="return_token_ids",
        action="store_false",
        help="do not send vLLM's return_token_ids (for servers that reject unknown fields)",
    )
    c.add_argument(
        "--stream-logprobs",
        choices=("on", "off"),
        default="off",
        help="also ask for logprobs=0: token counts per chunk for servers without "
        "return_token_ids (costs the server a log-softmax per step)",
    )
    c.add_argument(
        "--no-cache-salt",
        dest="salt_runs",
        action="store_false",
        help="do not send a cache_salt per run (runs on one server then share KV)",
    )
    c.add_argument(
        "--host-full-bytes",
        type=size,
        default=8 << 20,
        metavar="SIZE",
        help="host tier of the host_full scenario (default 8MiB)",
    )
    c.add_argument("--timeout-s", type=_positive_float, default=600.0, help="per request (default 600)")
    c.add_argument(
        "--out", default="bench-out", metavar="DIR", help="where JSON, Markdown and PNGs go (default ./bench-out)"
    )
    c.add_argument("--name", default=None, help="file name stem (default WORKLOAD_SCENARIO)")
    c.add_argument("--json", action="store_true", help="print the result JSON (default: the Markdown)")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    fields = {k[3:]: v for k, v in vars(args).items() if k.startswith("wl_")}
    wc = WorkloadConfig(
        seed=args.workload_seed,
        vocab_size=args.vocab_size,
        output_tokens=args.output_tokens,
        rate=args.rate,
        trace=args.trace,
        block_tokens=args.block_tokens,
        trace_block_tokens=args.trace_block_tokens,
        speedup=args.speedup,
        limit=args.limit,
        trace_output=args.trace_output_lengths,
        **fields,
    )
    logprobs = args.stream_logprobs == "on"
    return BenchConfig(
        workload=args.workload,
        workload_config=wc,
        scenario=args.scenario,
        url=args.url,
        model=args.model,
        engine_kwargs=dict(args.engine_kwargs),
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        tenant_keys=args.tenant_keys,
        concurrency=args.concurrency,
        concurrency_sweep=args.concurrency_sweep,
        text_prompts=args.text_prompts,
        logprobs=logprobs,
        return_token_ids=args.return_token_ids,
        salt_runs=args.salt_runs,
        host_full_bytes=args.host_full_bytes,
        timeout_s=args.timeout_s,
        progress=args.progress,
        out_dir=Path(args.out),
        name=args.name,
        command=command_line(args),
    )


_SECRET_DESTS = ("api_key", "tenant_keys")


def command_line(args: argparse.Namespace) -> str:
    """`kvtier bench` with the flags whose values differ from their defaults (API keys elided):
    the command that reproduces the run."""
    parser = getattr(args, "subparser", None)
    words = ["kvtier", "bench"]
    for action in getattr(parser, "_actions", []):
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if action.nargs == 0:
            words.append(flag)
        elif action.dest in _SECRET_DESTS:
            words += [flag, "..."]
        elif isinstance(value, list):
            for item in value:
                words += [flag, "=".join(item) if isinstance(item, tuple) else str(item)]
        elif isinstance(value, tuple):
            words += [flag, ",".join(map(str, value))]
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def run_bench(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ImportError("kvtier bench needs httpx: pip install 'kvtier[bench]'") from None
    if args.workload == "trace" and not args.trace:
        raise ValueError("--workload trace needs --trace FILE.jsonl (Mooncake format)")
    result = run(config_from_args(args))
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(Path(result["files"]["markdown"]).read_text())
    print(
        f"kvtier: wrote {result['files']['json']}, {result['files']['markdown']}"
        + "".join(f", {p}" for p in result["files"]["plots"]),
        file=sys.stderr,
    )
    iso = result.get("isolation")
    if iso is not None and not iso["passed"]:
        return 1
    errors = sum(r["summary"]["errors"] for r in result["runs"].values())
    return 1 if errors else 0
