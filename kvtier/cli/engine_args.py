"""The engine and tier flags every engine-building command takes (`kvtier bench` included).

`add_engine_args` adds them to a subcommand's parser and `engine_kwargs` turns them into
`LLM(...)` keyword arguments; a flag that is not given is left out, so the LLM constructor's
defaults apply. Torch-free: flags are checked before torch loads.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvtier.cli.args import fraction, integer, positive_float, positive_int, size
from kvtier.model.kv_names import KV_CACHE_DTYPES  # torch-free: flags are checked before torch loads

# torch-free too (tests/test_boundaries.py checks it): `kvtier --help` and flag errors do not wait for torch
from kvtier.tiers.hierarchy import TIER_ORDER as TIERS
from kvtier.tiers.hierarchy import WRITE_POLICIES
from kvtier.vllm_flags import add_vllm_flags, max_model_len

__all__ = ["DTYPES", "ENGINE_KEYS", "KV_CACHE_DTYPES", "TIER_KEYS", "add_engine_args", "engine_kwargs"]

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _kv_events_config(text: str) -> dict[str, Any]:
    """--kv-events-config: a JSON object of vLLM's KVEventsConfig fields, checked here."""
    from kvtier.kv_events import KVEventsConfig  # light: no torch

    try:
        config = KVEventsConfig.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert config is not None
    return dataclasses.asdict(config)


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


QUANTIZATION_CHOICES = ("gguf", "int8", "none")


def _quantization(text: str) -> str:
    value = text.strip().lower()
    if value not in QUANTIZATION_CHOICES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not supported: kvtier quantizes weights itself (gguf: a GGUF file's own "
            "blocks; int8: weight-only at load; none); for a checkpoint quantized with another "
            "method, serve its unquantized checkpoint with --quantization int8"
        )
    return value


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
    e.add_argument(
        "--quantization",
        "-q",
        type=_quantization,
        metavar="{" + ",".join(QUANTIZATION_CHOICES) + "}",
        default=None,
        help="how the projections hold their weights: gguf (a GGUF file's quantized blocks, the "
        "default for a GGUF on CPU), int8 (8-bit weight-only, quantized at load), none (the model "
        "dtype; a GGUF dequantized at load). Default: gguf for a GGUF file on CPU, else none",
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
        type=max_model_len,
        default=None,
        metavar="N",
        help="context length in tokens, prompt and output: 4096, 4k (4000), 4K (4096), or auto / -1 "
        "(default: the checkpoint's)",
    )
    e.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|HUB_ID",
        help="the tokenizer's directory (or a cached hub id), when not the model's",
    )
    e.add_argument(
        "--revision",
        default=None,
        metavar="REV",
        help="with a hub id: the branch, tag or commit of the cached snapshot to serve (default main)",
    )
    e.add_argument(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="the Hugging Face cache holding hub ids (default HF_HUB_CACHE, HF_HOME/hub or "
        "~/.cache/huggingface/hub); kvtier never downloads",
    )
    pool = e.add_mutually_exclusive_group()
    pool.add_argument("--num-device-blocks", type=positive_int, default=None, help="blocks in the device KV pool")
    pool.add_argument(
        "--kv-cache-bytes",
        "--kv-cache-memory-bytes",
        type=size,
        default=None,
        metavar="SIZE",
        help="bytes of the device KV pool, e.g. 2GiB (vLLM's --kv-cache-memory-bytes; default: a share of free memory)",
    )
    pool.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=None,
        metavar="FRACTION",
        help="vLLM's meaning: the share of the machine's memory this instance may use, weights "
        "included; the KV pool takes the rest, capped to the memory available at start",
    )
    pool.add_argument(
        "--kv-cache-memory-fraction",
        type=fraction,
        default=None,
        metavar="FRACTION",
        help="the share of the memory available after the weights that the KV pool takes "
        "(default 0.25, at most 4GiB when no pool size is given)",
    )
    e.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="publish the KV cache's contents as vLLM-format KV events for KV-aware routers "
        "(vLLM's KVEventsConfig fields, e.g. '{\"enable_kv_cache_events\": true, "
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\')',
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
    e.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts across steps, within --max-num-batched-tokens (default on)",
    )
    e.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve PEFT LoRA adapters (--lora-modules, or named per request), as vLLM",
    )
    e.add_argument("--max-loras", type=positive_int, default=None, help="distinct adapters per step (default 1)")
    e.add_argument("--max-lora-rank", type=positive_int, default=None, help="the largest adapter rank (default 16)")
    e.add_argument(
        "--max-cpu-loras", type=positive_int, default=None, help="adapters kept loaded (default: --max-loras)"
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
    add_vllm_flags(parser)


ENGINE_KEYS = (
    "dtype",
    "quantization",
    "kv_events_config",
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
    "kv_cache_memory_fraction",
    "enable_chunked_prefill",
    "tokenizer",
    "revision",
    "download_dir",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
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
    lora = [k for k in ("max_loras", "max_lora_rank", "max_cpu_loras") if k in kw]
    if lora and not kw.get("enable_lora"):
        fail(f"argument --{lora[0].replace('_', '-')}: needs --enable-lora")
    tiers_on = any(k in kw for k in ("host_cache_bytes", "disk_cache_dir", "remote_cache_url"))
    if tiers_on and kw.get("enable_prefix_caching") is False:
        fail("tiers below the device need prefix caching; drop --no-prefix-caching")
    return kw
