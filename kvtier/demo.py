"""`kvtier demo`: a shared-prefix workload on a built-in, untrained model; no download.

Builds a random-weight Llama-architecture model with a byte-level tokenizer (once, into a cache
directory), then:

1. serves requests that share a long system prompt: the first pays the prefill, the rest reuse
   its KV from the device prefix cache. Prints cold vs warm TTFT and cached tokens.
2. serves the same long prompt four ways on engines with a small device pool: (a) from the
   device (an immediate revisit), (b) from the host tier (after other prompts pushed it out of
   the device), (c) from the disk tier (a fresh engine on the same disk directory: a warm
   start), (d) recomputed (a fresh engine without tiers). Prints TTFT, cached tokens by tier and
   the restore decision of each.
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

DEMO_MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                  intermediate_size=1408, max_position_embeddings=8192, dtype="bfloat16", seed=0)

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
FILLER_TEXT = ("Unrelated maintenance log: rotated certificates, resized volumes, patched kernels, "
               "rebalanced shards, and archived old metrics. ")

DEMO_HOST_CACHE_BYTES = 512 << 20
"""Host tier of part two unless --host-cache-bytes says otherwise (used only as far as filled)."""
TIER_COLUMNS = ("device", "host", "disk", "remote")


def default_model_dir() -> Path:
    base = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
    return base / "demo-model-v1"


def ensure_demo_model(model_dir: Path | None = None) -> Path:
    """Build the demo checkpoint if it is not there yet (about a second)."""
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
    """bfloat16 on a GPU; float32 on a CPU, where bfloat16 matmuls are several times slower."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def run_demo(model_dir: str | None = None, prefix_repeats: int = 12, max_tokens: int = 4,
             out=sys.stdout, tiers: bool = True, engine_kwargs: dict[str, Any] | None = None) -> dict:
    """Run both parts; returns a summary (TTFTs in ms, cached tokens).

    `engine_kwargs` are LLM(...) arguments from the command line. Engine flags apply to both
    parts (part two always sizes its own small device pool); tier flags configure part two.
    """
    from kvtier import LLM, SamplingParams

    path = ensure_demo_model(Path(model_dir) if model_dir else None)
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    kw = dict(engine_kwargs or {})
    tier_kw = {k: kw.pop(k) for k in list(kw) if k in _TIER_KEYS}
    kw.setdefault("dtype", _demo_dtype())
    kw.setdefault("block_size", 16)
    part1_kw = dict(kw)
    if "kv_cache_bytes" not in part1_kw:
        part1_kw.setdefault("num_device_blocks", 1024)
    caching = kw.get("enable_prefix_caching", True)

    p("kvtier demo")
    p(f"  model: {path} ({kw['dtype']})")
    p("  NOTE: this model is UNTRAINED (random weights, byte-level tokenizer). Its text is noise;")
    p("        the demo measures the KV cache, not answer quality.")
    system = SYSTEM_PROMPT * prefix_repeats
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # Prime the kernels on an unrelated prompt, so "cold" measures the cache, not first-call costs.
    warm_up = ("Unrelated text to prime the kernels. " * 8)[:min(len(system), 256)]

    p("\n  part one: requests sharing a system prompt, device prefix cache"
      + ("" if caching else " (OFF: --no-prefix-caching)"))
    with LLM(str(path), **part1_kw) as llm:
        tokenizer = llm.tokenizer
        llm.generate(_no_bos(tokenizer, warm_up), SamplingParams(max_tokens=2))
        rows = []
        p(f"\n  {'request':<46} {'prompt':>7} {'cached':>7} {'TTFT ms':>9}")
        for i, q in enumerate(QUESTIONS):
            o = llm.generate(system + "\nUser: " + q, sp)[0]
            rows.append(o)
            kind = "cold" if i == 0 else "warm"
            p(f"  {kind + ': ' + q[:38]:<46} {len(o.prompt_token_ids):>7} {o.num_cached_tokens:>7} "
              f"{o.metrics.ttft_s * 1e3:>9.1f}")
        llm.check_integrity()
    cold = rows[0].metrics.ttft_s
    warm = statistics.median(o.metrics.ttft_s for o in rows[1:])
    # Same prompts with the cache off: what every request would cost without reuse. (The kernels
    # are warm already: same process.)
    with LLM(str(path), **{**part1_kw, "enable_prefix_caching": False}) as nocache:
        t = [nocache.generate(system + "\nUser: " + q, sp)[0].metrics.ttft_s for q in QUESTIONS[:3]]
    summary: dict[str, Any] = {
        "prompt_tokens": len(rows[0].prompt_token_ids),
        "cold_ttft_ms": round(cold * 1e3, 1),
        "warm_ttft_ms_median": round(warm * 1e3, 1),
        "no_cache_ttft_ms_median": round(statistics.median(t) * 1e3, 1),
        "speedup_warm_vs_cold": round(cold / warm, 1),
        "cached_tokens_median": int(statistics.median(o.num_cached_tokens for o in rows[1:])),
    }
    p(f"\n  cold TTFT {summary['cold_ttft_ms']} ms, warm TTFT (median) {summary['warm_ttft_ms_median']} ms "
      f"-> {summary['speedup_warm_vs_cold']}x faster; without prefix caching: "
      f"{summary['no_cache_ttft_ms_median']} ms")
    p(f"  warm requests reused {summary['cached_tokens_median']} of {summary['prompt_tokens']} prompt tokens")
    p(f"  sample output (noise, untrained): {rows[1].outputs[0].text[:40]!r}")

    if not tiers:
        return summary
    if not caching:
        p("\n  part two skipped: tiers below the device need prefix caching (drop --no-prefix-caching)")
        return summary
    summary.update(_four_ways(path, system + "\nUser: " + QUESTIONS[1], sp, kw, tier_kw, tokenizer, p))
    return summary


_TIER_KEYS = ("host_cache_bytes", "disk_cache_dir", "disk_cache_bytes", "remote_cache_url",
              "remote_ttl_s", "cache_write_policy", "cache_compression", "tier_faults")


def _four_ways(path: Path, prompt: str, sp, kw: dict[str, Any], tier_kw: dict[str, Any],
               tokenizer, p) -> dict[str, Any]:
    """Part two: one prompt from device, host, disk, and recomputed."""
    from kvtier import LLM, SamplingParams

    bs = kw["block_size"]
    n = len(tokenizer.encode(prompt))
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

    p(f"\n  part two: the same {n}-token prompt from each tier ({policy})")
    p(f"    device pool {pool} blocks of {bs} tokens, host {_human(tiers['host_cache_bytes'])}, "
      f"disk {disk_dir}{' (temporary)' if own_dir else ''}")
    results: dict[str, Any] = {}
    try:
        with LLM(str(path), **base, **tiers) as llm:
            llm.generate(prompt, sp)  # first visit: computes it; write-through stores it below
            results["device"] = llm.generate(prompt, sp)[0]  # (a) immediate revisit
            # (b) push it out of the device with other prompts, then come back
            filled, i = 0, 0
            while filled < pool + 2:
                blocks = min(prompt_blocks, pool + 2 - filled)
                text = f"{i} " + FILLER_TEXT * (blocks * bs // len(FILLER_TEXT) + 1)
                llm.generate(_no_bos(tokenizer, text, max(blocks * bs - 1, 1)), one)
                filled += blocks
                i += 1
            results["host"] = llm.generate(prompt, sp)[0]
            llm.check_integrity()
        # close() above finished the queued disk writes
        # (c) a fresh engine on the same disk directory, without a host tier: a warm start
        with LLM(str(path), **base, **{k: v for k, v in tiers.items() if k != "host_cache_bytes"}) as llm:
            results["disk"] = llm.generate(prompt, sp)[0]
            llm.check_integrity()
    finally:
        if own_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    # (d) a fresh engine without tiers: cold
    with LLM(str(path), **base) as llm:
        llm.generate(_no_bos(tokenizer, "Prime the kernels once."), SamplingParams(max_tokens=1))
        results["recompute"] = llm.generate(prompt, sp)[0]

    labels = {"device": "(a) device: immediate revisit", "host": "(b) host: after device eviction",
              "disk": "(c) disk: fresh engine, warm start", "recompute": "(d) recompute: no tiers"}
    cols = [c for c in TIER_COLUMNS if c != "remote" or tiers.get("remote_cache_url")]
    p(f"\n  {'':<36} {'':>9}  {'cached tokens by tier':>{8 * len(cols) - 1}}")
    p(f"  {'served from':<36} {'TTFT ms':>9}  " + " ".join(f"{c:>7}" for c in cols)
      + f" {'computed':>9}  decision")
    summary: dict[str, Any] = {"prompt_tokens_part_two": n}
    detail = {}
    for name, o in results.items():
        ttft_ms = round(o.metrics.ttft_s * 1e3, 1)
        by_tier = {c: o.cached_tokens_by_tier.get(c, 0) for c in cols}
        p(f"  {labels[name]:<36} {ttft_ms:>9.1f}  " + " ".join(f"{by_tier[c]:>7}" for c in cols)
          + f" {o.num_recomputed_tokens:>9}  {o.restore_decision or '- (no tiers)'}")
        summary[f"{name}_ttft_ms"] = ttft_ms
        detail[name] = {"ttft_ms": ttft_ms, "cached_tokens_by_tier": dict(o.cached_tokens_by_tier),
                        "num_recomputed_tokens": o.num_recomputed_tokens,
                        "restore_decision": o.restore_decision}
    summary["tiers"] = detail
    rec = summary["recompute_ttft_ms"]
    served = [name for name in ("device", "host", "disk")
              if results[name].cached_tokens_by_tier.get(name, 0) > 0 and summary[f"{name}_ttft_ms"] > 0]
    if served:
        p("  " + ", ".join(f"{name} {rec / summary[f'{name}_ttft_ms']:.1f}x" for name in served)
          + " faster than recomputing")
    if policy != "write_through":
        p(f"  note: with {policy}, blocks reach the disk later (or not at all in a short run); "
          f"write_through stores them at once")
    return summary


def _no_bos(tokenizer, text: str, limit: int | None = None) -> dict[str, list[int]]:
    """An unrelated prompt without the BOS token: the requests under test all start with BOS, and
    token-granular matching would otherwise reuse (and so keep fresh) their first block."""
    return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)[:limit]}


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
