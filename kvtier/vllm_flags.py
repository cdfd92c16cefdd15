"""vLLM 0.32 `vllm serve` flags and `LLM(...)` arguments that kvtier has no flag of its own for:
each is a documented no-op (it cannot matter on this engine), or refused with one line that says
what to do instead. Never silently ignored, never a traceback.

`add_vllm_flags(parser)` adds them to `kvtier serve` (and the other engine commands);
`check_vllm_flags(args)` runs after parsing, before any model loads: it raises ValueError (one
line) for a refused flag or value and returns the notes to log for the no-ops. `check_llm_kwargs`
does the same for `LLM(**kwargs)`. `markdown_table()` is the README's table of every vLLM flag
kvtier knows (its own implemented ones included): `python -m kvtier.vllm_flags` prints it.
Standard library only: flags are checked before torch loads.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "IMPLEMENTED",
    "VLLM_FLAGS",
    "VllmFlag",
    "add_vllm_flags",
    "check_llm_kwargs",
    "check_vllm_flags",
    "human_readable_int",
    "markdown_table",
    "max_model_len",
]

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_readable_int(text: str) -> int:
    """vLLM's integers with a suffix: lower case decimal ('4k' = 4000, '25.6k' = 25600), upper
    case binary ('4K' = 4096; no decimals), or plain ('4096')."""
    value = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value)
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r} (e.g. 4096, 4k, 4K)")
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: decimals go with k/m/g/t only (e.g. 25.6k)")
    return int(number) * _BINARY.get(suffix, 1)


def max_model_len(text: str) -> int | None:
    """--max-model-len: a positive count as `human_readable_int`, or 'auto' / -1 (vLLM's spelling
    for the largest that fits: kvtier takes the checkpoint's context length, which a pool too
    small for one sequence still refuses at start). None stands for auto."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, 'auto' or -1, got {text!r}")
    return value


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag kvtier accepts without a kvtier meaning, or refuses.

    `status` is 'no-op' (accepted: `note` says why it cannot matter here) or 'refused' (`note` is
    the one line printed: what to do instead). `allowed`, for a no-op taking a value, names the
    values that are a no-op; any other value is refused with `note_other`."""

    flags: tuple[str, ...]
    status: str
    note: str
    kind: str = "bool"  # bool (BooleanOptionalAction), int, str, json
    allowed: tuple[str, ...] = ()
    note_other: str = ""
    llm_kwarg: str | None = None

    @property
    def dest(self) -> str:
        return "vllm_" + self.flags[0].lstrip("-").replace("-", "_")


_PARALLEL = (
    "kvtier runs one engine per process on the CPU; scale out with several instances behind "
    "vllm-router or on Ray Serve (see the README's fleet section)"
)

VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(
        ("--tensor-parallel-size", "-tp"),
        "no-op",
        "1 is the only size: one engine per process",
        kind="int",
        allowed=("1",),
        note_other=_PARALLEL,
        llm_kwarg="tensor_parallel_size",
    ),
    VllmFlag(
        ("--pipeline-parallel-size", "-pp"),
        "no-op",
        "1 is the only size",
        kind="int",
        allowed=("1",),
        note_other=_PARALLEL,
        llm_kwarg="pipeline_parallel_size",
    ),
    VllmFlag(
        ("--data-parallel-size", "-dp"),
        "no-op",
        "1 is the only size",
        kind="int",
        allowed=("1",),
        note_other=_PARALLEL,
        llm_kwarg="data_parallel_size",
    ),
    VllmFlag(
        ("--distributed-executor-backend",),
        "no-op",
        "mp and uni: kvtier's engine has its own process (or --engine-in-process)",
        kind="str",
        allowed=("mp", "uni"),
        note_other=_PARALLEL,
        llm_kwarg="distributed_executor_backend",
    ),
    VllmFlag(
        ("--trust-remote-code",),
        "no-op",
        "kvtier runs no code from the checkpoint: the architectures it serves are built in, "
        "and any other is refused at load",
        llm_kwarg="trust_remote_code",
    ),
    VllmFlag(
        ("--enforce-eager",),
        "no-op",
        "kvtier has no CUDA graphs or torch.compile to turn off",
        llm_kwarg="enforce_eager",
    ),
    VllmFlag(
        ("--compilation-config", "-O"),
        "no-op",
        "kvtier does not compile the model (no CUDA graphs, no torch.compile)",
        kind="str",
        llm_kwarg="compilation_config",
    ),
    VllmFlag(
        ("--max-seq-len-to-capture",),
        "no-op",
        "CUDA-graph capture length: kvtier captures no graphs",
        kind="int",
        llm_kwarg="max_seq_len_to_capture",
    ),
    VllmFlag(
        ("--async-scheduling",),
        "no-op",
        "kvtier's engine process already schedules and detokenizes apart from the HTTP server",
        llm_kwarg="async_scheduling",
    ),
    VllmFlag(
        ("--disable-custom-all-reduce",),
        "no-op",
        "no all-reduce: one engine per process",
        llm_kwarg="disable_custom_all_reduce",
    ),
    VllmFlag(
        ("--disable-log-stats",),
        "no-op",
        "kvtier logs no periodic stats line; /metrics has them",
        llm_kwarg="disable_log_stats",
    ),
    VllmFlag(
        ("--disable-log-requests",),
        "no-op",
        "deprecated in vLLM; requests are logged only with --enable-log-requests",
    ),
    VllmFlag(
        ("--swap-space",),
        "no-op",
        "vLLM's CPU swap space for preempted sequences; kvtier recomputes or restores them from "
        "its tiers (--host-cache-bytes sizes the host tier)",
        kind="str",
        llm_kwarg="swap_space",
    ),
    VllmFlag(
        ("--tokenizer-mode",),
        "no-op",
        "auto, hf and slow all read the checkpoint's tokenizer.json",
        kind="str",
        allowed=("auto", "hf", "slow"),
        note_other="kvtier reads Hugging Face tokenizer.json files only; drop --tokenizer-mode",
        llm_kwarg="tokenizer_mode",
    ),
    VllmFlag(
        ("--load-format",),
        "no-op",
        "auto, safetensors and gguf: kvtier reads the checkpoint's own format",
        kind="str",
        allowed=("auto", "safetensors", "gguf"),
        note_other="kvtier loads safetensors checkpoints and GGUF files; convert the checkpoint "
        "(or use --load-format auto)",
        llm_kwarg="load_format",
    ),
    VllmFlag(
        ("--device",),
        "no-op",
        "auto and cpu: kvtier serves on the CPU here (the device is chosen at load)",
        kind="str",
        allowed=("auto", "cpu"),
        note_other="kvtier's server runs on the CPU; use --device cpu or leave it out",
    ),
    VllmFlag(
        ("--kv-transfer-config",),
        "refused",
        "kvtier serve is itself the KV tiering: give it --host-cache-bytes, --disk-cache-dir or "
        "--remote-cache-url; to use kvtier inside vLLM, pass --kv-transfer-config to `vllm serve` "
        "(README: kvtier inside vLLM)",
        kind="json",
        llm_kwarg="kv_transfer_config",
    ),
    VllmFlag(
        ("--speculative-config",),
        "refused",
        "kvtier has no speculative decoding; drop --speculative-config",
        kind="json",
        llm_kwarg="speculative_config",
    ),
    VllmFlag(
        ("--reasoning-parser",),
        "refused",
        "kvtier does not split reasoning out of the reply (it stays in content); drop --reasoning-parser",
        kind="str",
    ),
    VllmFlag(
        ("--cpu-offload-gb",),
        "refused",
        "kvtier keeps the weights in memory; what it offloads is KV (--host-cache-bytes, "
        "--disk-cache-dir, --remote-cache-url)",
        kind="str",
        llm_kwarg="cpu_offload_gb",
    ),
    VllmFlag(
        ("--hf-overrides",),
        "refused",
        "kvtier reads config.json as it is; edit a copy of the checkpoint's config.json instead",
        kind="json",
        llm_kwarg="hf_overrides",
    ),
    VllmFlag(
        ("--limit-mm-per-prompt",),
        "refused",
        "kvtier serves text-only models; drop --limit-mm-per-prompt",
        kind="json",
        llm_kwarg="limit_mm_per_prompt",
    ),
    VllmFlag(
        ("--enable-expert-parallel",),
        "refused",
        "kvtier serves dense models only (no MoE); drop --enable-expert-parallel",
        llm_kwarg="enable_expert_parallel",
    ),
    VllmFlag(
        ("--enable-sleep-mode",),
        "refused",
        "kvtier has no sleep mode; stop the instance and start it again (its disk and Redis tiers keep the KV)",
        llm_kwarg="enable_sleep_mode",
    ),
    VllmFlag(
        ("--tokenizer-revision",),
        "refused",
        "give --tokenizer a local directory (or a hub id at the --revision of the model)",
        kind="str",
        llm_kwarg="tokenizer_revision",
    ),
)

IMPLEMENTED: tuple[tuple[str, str], ...] = (
    ("MODEL (positional), --model", "a local directory, a .gguf file or a hub id found in the Hugging Face cache"),
    ("--revision, --download-dir", "which cached snapshot of a hub id, and which cache (no download)"),
    ("--tokenizer", "a tokenizer directory (or a cached hub id) other than the model's"),
    ("--host, --port, --served-model-name, --api-key", "as vLLM"),
    ("--dtype", "auto keeps the checkpoint's dtype (vLLM picks 16-bit for a float32 checkpoint)"),
    ("--max-model-len", "also 4k / 4K / auto / -1, as vLLM"),
    (
        "--gpu-memory-utilization",
        "vLLM's meaning: the share of the machine's memory this instance may use, weights "
        "included, checked at start (kvtier's own share-of-free-memory is --kv-cache-memory-fraction)",
    ),
    ("--kv-cache-memory-bytes", "the KV pool's size in bytes (kvtier's --kv-cache-bytes)"),
    ("--kv-cache-dtype, --block-size, --max-num-seqs, --max-num-batched-tokens, --seed", "as vLLM"),
    ("--enable-prefix-caching / --no-enable-prefix-caching", "as vLLM (on by default)"),
    ("--enable-chunked-prefill / --no-enable-chunked-prefill", "as vLLM (on by default)"),
    ("--scheduling-policy", "fcfs or priority"),
    ("--quantization", "gguf, int8 (weight-only, at load) or none; other methods are refused"),
    ("--generation-config, --override-generation-config", "as vLLM"),
    ("--chat-template, --trust-request-chat-template, --response-role", "as vLLM"),
    ("--enable-auto-tool-choice, --tool-call-parser", "as vLLM (kvtier's parsers are listed in --help)"),
    ("--structured-outputs-config", "llguidance is kvtier's grammar engine"),
    ("--allowed-origins, --root-path, --ssl-keyfile, --ssl-certfile, --ssl-ca-certs", "as vLLM"),
    ("--uvicorn-log-level, --disable-uvicorn-access-log", "as vLLM"),
    ("--enable-log-requests, --max-log-len", "as vLLM"),
    ("--return-tokens-as-token-ids, --enable-prompt-tokens-details, --enable-force-include-usage", "as vLLM"),
    ("--enable-server-load-tracking", "GET /load, as vLLM"),
    ("--enable-tokenizer-info-endpoint", "GET /tokenizer_info, as vLLM"),
    ("--kv-events-config", "vLLM-format KV events for KV-aware routers"),
    (
        "--enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras",
        "PEFT LoRA adapters, as vLLM (a request's model names one; /v1/load_lora_adapter)",
    ),
    ("--disable-frontend-multiprocessing", "the engine on a thread of the server process (--engine-in-process)"),
)
"""vLLM flags with the same meaning in kvtier (kvtier's own flags implement them)."""


def _json_text(text: str) -> str:
    return text


_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "str": str, "json": _json_text}


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The no-op and refused vLLM flags, in their own help group."""
    g = parser.add_argument_group(
        "vLLM flags without a kvtier meaning", "accepted as no-ops or refused with one line (README: vLLM flags)"
    )
    for f in VLLM_FLAGS:
        help_text = f"{f.status}: {f.note}"
        if f.kind == "bool":
            g.add_argument(*f.flags, dest=f.dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            g.add_argument(*f.flags, dest=f.dest, type=_TYPES[f.kind], default=None, metavar="VALUE", help=help_text)


def _check(f: VllmFlag, value: Any, name: str) -> str | None:
    if f.status == "refused":
        if value is False:  # --no-enable-sleep-mode and the like ask for what kvtier does
            return None
        raise ValueError(f"{name} is not supported: {f.note}")
    if f.allowed and str(value) not in f.allowed:
        raise ValueError(f"{name} {value}: not supported: {f.note_other}")
    return f"{name}{'' if isinstance(value, bool) else f' {value}'} accepted, no effect: {f.note}"


def check_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Raise ValueError (one line) for a refused vLLM flag or value; return one note per no-op
    flag given, for the log."""
    notes = []
    for f in VLLM_FLAGS:
        value = getattr(args, f.dest, None)
        if value is not None:
            note = _check(f, value, f.flags[0])
            if note:
                notes.append(note)
    return notes


_BY_KWARG = {f.llm_kwarg: f for f in VLLM_FLAGS if f.llm_kwarg}
LLM_KWARGS = frozenset(_BY_KWARG)
"""The vLLM `LLM(...)` keyword arguments `check_llm_kwargs` takes."""


def check_llm_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """`LLM(**kwargs)` beyond kvtier's own arguments: TypeError for a name vLLM's LLM does not
    take either (as Python would), ValueError (one line) for a refused one, notes for no-ops."""
    notes = []
    for key, value in kwargs.items():
        f = _BY_KWARG.get(key)
        if f is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
        if value is None:
            continue
        note = _check(f, value, key)
        if note:
            notes.append(note)
    return notes


def markdown_table() -> str:
    """The README's table: every vLLM flag kvtier knows, with what kvtier does with it."""
    rows = ["| vLLM flag | in kvtier |", "| --- | --- |"]
    rows += [f"| `{flags}` | implemented: {what} |" for flags, what in IMPLEMENTED]
    for f in VLLM_FLAGS:
        names = ", ".join(f"`{name}`" for name in f.flags)
        if f.status == "refused":
            rows.append(f"| {names} | refused: {f.note} |")
        elif f.allowed:
            rows.append(f"| {names} | no-op for {' / '.join(f.allowed)} ({f.note}); else refused |")
        else:
            rows.append(f"| {names} | no-op: {f.note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
