"""Token workloads shared by every engine in the comparison (kvtier, transformers, vLLM-CPU).

Pure Python (no torch), so the vLLM worker can import it from its own virtual environment.
Every prompt is deterministic: the same seed gives the same token ids in every process.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

VOCAB = 32000
FIRST_TOKEN = 100  # stay clear of special ids


def tokens(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def cold_prefill(prompt_len: int = 2048) -> dict:
    """One prompt, max_tokens=1: the time is the prefill."""
    return {"prompt": tokens(1, prompt_len), "max_tokens": 1}


def warm_ttft(prefix_len: int = 2048, new_tokens: int = 4) -> dict:
    """Serve `prefix` once (warm-up), then time prefix + new tokens (a prefix-cache hit)."""
    prefix = tokens(2, prefix_len)
    return {"warmup": prefix, "prompt": prefix + tokens(3, new_tokens), "max_tokens": 1}


def warm_batch(num_requests: int = 8, prefix_len: int = 512, new_tokens: int = 128, seed: int = 0) -> dict:
    """A wave of requests sharing one cached prefix, each with its own new tokens, prefilled together
    (max_tokens=1): what a server at concurrency 8 does when a wave of requests arrives, as in vLLM's
    serving benchmark with --random-prefix-len 512 --random-input-len 128. The prefix is served
    once first; repeat `seed` uses its own prefix."""
    prefix = tokens(8000 + seed, prefix_len)
    return {
        "warmup": prefix,
        "prompts": [prefix + tokens(9000 + 100 * seed + i, new_tokens) for i in range(num_requests)],
        "max_tokens": 1,
    }


def throughput(num_requests: int = 16, prompt_len: int = 256, max_tokens: int = 128) -> dict:
    """Distinct prompts (no sharing), fixed output length (ignore_eos): output tokens / s."""
    return {"prompts": [tokens(1000 + i, prompt_len) for i in range(num_requests)], "max_tokens": max_tokens}


def pressure(num_prefixes: int = 24, prefix_len: int = 2048, new_tokens: int = 16) -> dict:
    """Distinct long prefixes, each served once then revisited after all were seen."""
    prefixes = [tokens(5000 + i, prefix_len) for i in range(num_prefixes)]
    suffix = [tokens(6000 + i, new_tokens) for i in range(num_prefixes)]
    return {
        "first": [p + s for p, s in zip(prefixes, suffix)],
        "revisit": [p + tokens(7000 + i, new_tokens) for i, p in enumerate(prefixes)],
        "max_tokens": 1,
    }


LONG_LENGTHS = (1024, 2048, 4096, 8186)
"""Prompt lengths of the long-context workload (8,186 + 4 new tokens + 1 output fit a model of 8,192 positions)."""


def long_context(lengths: tuple[int, ...] = LONG_LENGTHS, new_tokens: int = 4) -> dict:
    """Per length: cold prefill of a fresh prompt (max_tokens=1), and warm TTFT of a cached prefix of
    that length plus `new_tokens` (served once first). Prompts of repeat r use seeds 100 * r + i."""
    return {"lengths": list(lengths), "new_tokens": new_tokens, "max_tokens": 1}


def long_throughput(num_requests: int = 4, prompt_len: int = 4096, max_tokens: int = 128) -> dict:
    """Few long prompts decoded together: output tokens / s (prefill included), as `throughput`."""
    return throughput(num_requests, prompt_len, max_tokens)


THROUGHPUT_WORKLOADS = {
    "throughput": (16, 256, 128),
    "throughput_32x512": (32, 512, 256),
    "throughput_64x512": (64, 512, 256),
    "long_throughput": (4, 4096, 128),
}
"""Throughput workloads by name: (requests, prompt tokens, output tokens)."""


def throughput_spec(name: str) -> dict:
    """The named throughput workload (THROUGHPUT_WORKLOADS)."""
    return throughput(*THROUGHPUT_WORKLOADS[name])


def run_long_context(timed: Callable[[list[int]], float], spec: dict, repeats: int) -> dict:
    """The long-context workload through `timed(prompt) -> seconds` (one request, max_tokens=1):
    the same prompts, in the same order, for every engine."""
    cold_all, warm_all = [], []
    for i, n in enumerate(spec["lengths"]):
        cold, warm = [], []
        for r in range(repeats):
            cold.append(timed(tokens(100 * r + i + 1, n)))
            prefix = tokens(100 * r + i + 50, n)
            timed(prefix)  # warm-up: the prefix into the cache
            warm.append(timed(prefix + tokens(100 * r + i + 75, spec["new_tokens"])))
        cold_all.append(cold)
        warm_all.append(warm)
    return {
        "lengths": spec["lengths"],
        "cold_s": [statistics.median(c) for c in cold_all],
        "cold_all": cold_all,
        "warm_s": [statistics.median(w) for w in warm_all],
        "warm_all": warm_all,
    }
