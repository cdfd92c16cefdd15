"""`kvtier demo`: a shared-prefix workload on a built-in, untrained model; no download.

Builds a random-weight Llama-architecture model with a byte-level tokenizer (once, into a cache
directory), then serves requests that share a long system prompt: the first pays the prefill,
the rest reuse its KV. Prints cold vs warm TTFT and cached tokens.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

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
    tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
    vocab = build_byte_tokenizer(tmp)
    build_random_llama(tmp, vocab_size=vocab, bos_token_id=256, eos_token_id=257, **DEMO_MODEL)
    tmp.rename(model_dir) if not model_dir.exists() else None
    return model_dir


def run_demo(model_dir: str | None = None, prefix_repeats: int = 12, max_tokens: int = 16,
             out=sys.stdout) -> dict:
    from kvtier import LLM, SamplingParams

    path = ensure_demo_model(Path(model_dir) if model_dir else None)
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    p("kvtier demo")
    p(f"  model: {path}")
    p("  NOTE: this model is UNTRAINED (random weights, byte-level tokenizer). Its text is noise;")
    p("        the demo measures the KV cache, not answer quality.")
    llm = LLM(str(path), dtype="bfloat16", num_device_blocks=1024, block_size=16)
    system = SYSTEM_PROMPT * prefix_repeats
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # Prime the kernels on an unrelated prompt of the same length, so "cold" measures the cache.
    warm_up = "Unrelated text to prime the kernels. " * (len(system) // 37 + 1)
    llm.generate(warm_up[:len(system)], SamplingParams(max_tokens=2))

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
    # Same prompts with the cache off: what every request would cost without reuse.
    nocache = LLM(str(path), dtype="bfloat16", num_device_blocks=1024, enable_prefix_caching=False)
    nocache.generate(warm_up[:len(system)], SamplingParams(max_tokens=2))
    t = [nocache.generate(system + "\nUser: " + q, sp)[0].metrics.ttft_s for q in QUESTIONS[:3]]
    summary = {
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
    return summary
