"""/metrics scraped before and after a run, and what changed.

Counters (and histogram sums and counts) are differenced; the headline figures read kvtier's
series (names: kvtier/server/metrics.py) and, where kvtier's are absent, vLLM's prefix cache
counters. A server without /metrics, or with neither, yields None: the report leaves them out.
"""

from __future__ import annotations

from typing import Any

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

_DIFFERENCED_SUFFIXES = ("_total", "_sum", "_count", "_created")


def parse(text: str) -> Samples:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, timeout_s: float = 10.0) -> Samples | None:
    """The server's /metrics, or None when it has none (or it cannot be parsed)."""
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
        if r.status_code != 200:
            return None
        return parse(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def counter_deltas(before: Samples | None, after: Samples | None) -> Samples | None:
    """after - before for every counter-like sample (missing before: counted from 0)."""
    if before is None or after is None:
        return None
    out: Samples = {}
    for key, value in after.items():
        name = key[0]
        if name.endswith("_created") or not name.endswith(_DIFFERENCED_SUFFIXES):
            continue
        out[key] = value - before.get(key, 0.0)
    return out


def _by_label(deltas: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in deltas.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def _total(deltas: Samples, name: str) -> float | None:
    vals = [v for (n, _), v in deltas.items() if n == name]
    return sum(vals) if vals else None


def headline(deltas: Samples | None) -> dict[str, Any] | None:
    """The deltas a reader wants, per tier where the server labels them; None without metrics."""
    if not deltas:
        return None
    k = "kvtier:"
    if any(n.startswith(k) for n, _ in deltas):
        restore_sum = _by_label(deltas, k + "restore_seconds_sum", "tier")
        restore_count = _by_label(deltas, k + "restore_seconds_count", "tier")
        return {
            "server": "kvtier",
            "bytes_read_by_tier": _by_label(deltas, k + "tier_bytes_read_total", "tier"),
            "bytes_written_by_tier": _by_label(deltas, k + "tier_bytes_written_total", "tier"),
            "restore_seconds_by_tier": restore_sum,
            "restores_by_tier": restore_count,
            "recomputed_tokens": _total(deltas, k + "recomputed_tokens_total"),
            "prefix_queries_by_tier": _by_label(deltas, k + "prefix_cache_queries_total", "tier"),
            "prefix_hits_by_tier": _by_label(deltas, k + "prefix_cache_hits_total", "tier"),
            "restore_decisions": _by_label(deltas, k + "restore_decisions_total", "decision"),
            "preemptions": _total(deltas, k + "num_preemptions_total"),
            "tier_errors": {
                f"{dict(labels).get('tier')}/{dict(labels).get('kind')}": v
                for (n, labels), v in deltas.items()
                if n == k + "tier_errors_total" and v
            },
        }
    v = "vllm:"
    hits = _total(deltas, v + "prefix_cache_hits_total")
    queries = _total(deltas, v + "prefix_cache_queries_total")
    if hits is None and queries is None:
        return None
    return {
        "server": "vllm",
        "prefix_queries_by_tier": {"device": queries or 0.0},
        "prefix_hits_by_tier": {"device": hits or 0.0},
        "preemptions": _total(deltas, v + "num_preemptions_total"),
    }


def deltas_json(deltas: Samples | None) -> list[dict[str, Any]] | None:
    """Every nonzero delta as JSON rows (name, labels, value)."""
    if deltas is None:
        return None
    return [{"name": n, "labels": dict(labels), "delta": v} for (n, labels), v in sorted(deltas.items()) if v]
