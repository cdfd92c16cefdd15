"""Summaries of a run's records, the Markdown report and the plots."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.client import RequestRecord

QUANTILES = (0.5, 0.95, 0.99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(values: Iterable[float | None]) -> dict[str, Any]:
    xs = [v for v in values if v is not None]
    out: dict[str, Any] = {"n": len(xs)}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = percentile(xs, q)
    out["mean"] = sum(xs) / len(xs) if xs else None
    return out


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    return {
        "requests": len(ok),
        "ttft_s": dist(r.ttft_s for r in ok),
        "itl_s": dist(x for r in ok for x in r.itl_s),
        "tpot_s": dist(r.tpot_s for r in ok),
        "e2e_s": dist(r.e2e_s for r in ok),
    }


def cache_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    by_tier: dict[str, int] = {}
    for r in ok:
        for tier, n in (r.cached_tokens_by_tier or {}).items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    reported = any(r.cached_tokens is not None for r in ok)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached if reported else None,
        "cached_fraction": cached / prompt if reported and prompt else None,
        "cached_tokens_by_tier": by_tier or None,
        "ideal_cached_tokens": sum(min(r.seen_prefix_len, max((r.prompt_tokens or r.prompt_len) - 1, 0)) for r in ok),
    }


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """p50/p95/p99 (all, cold, warm, per tag), throughput and cached tokens of one run."""
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    s: dict[str, Any] = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_samples": [r.error for r in records if r.error][:5],
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        **latency_summary(ok),
        "cold": latency_summary([r for r in ok if not r.warm]),
        "warm": latency_summary([r for r in ok if r.warm]),
        "cache": cache_summary(ok),
    }
    s["cold"]["cache"] = cache_summary([r for r in ok if not r.warm])
    s["warm"]["cache"] = cache_summary([r for r in ok if r.warm])
    tags = sorted({r.tag for r in ok if r.tag})
    if tags:
        s["by_tag"] = {
            t: {**latency_summary([r for r in ok if r.tag == t]), "cache": cache_summary([r for r in ok if r.tag == t])}
            for t in tags
        }
    return s


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------ Markdown
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _latency_rows(name: str, s: dict[str, Any]) -> list[str]:
    t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
    return [
        f"| {name} | {s['requests']} | {_ms(t['p50'])} | {_ms(t['p95'])} | {_ms(t['p99'])} | "
        f"{_ms(i['p50'])} | {_ms(i['p95'])} | {_ms(e['p50'])} | {_ms(e['p95'])} |"
    ]


def run_markdown(title: str, run: dict[str, Any]) -> list[str]:
    s = run["summary"]
    lines = [f"### {title}", ""]
    lines.append(
        f"{s['requests']} requests ({s['errors']} errors) in {s['wall_s']:.1f} s: "
        f"{_num(s['requests_per_s'])} req/s, {_num(s['output_tokens_per_s'], '{:.1f}')} output tok/s."
    )
    c = s["cache"]
    if c["cached_tokens"] is not None:
        frac = c["cached_fraction"]
        lines.append(
            f"Cached prompt tokens: {c['cached_tokens']} of {c['prompt_tokens']} "
            f"({_num(frac * 100 if frac is not None else None, '{:.1f}')}%), by tier "
            f"{c['cached_tokens_by_tier'] or {}}; an ideal cache: {c['ideal_cached_tokens']}."
        )
    lines += [
        "",
        "| requests | n | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | ITL p50 ms | ITL p95 ms | "
        "E2E p50 ms | E2E p95 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += _latency_rows("all", s)
    lines += _latency_rows("cold", s["cold"])
    lines += _latency_rows("warm", s["warm"])
    for tag, ts in (s.get("by_tag") or {}).items():
        lines += _latency_rows(f"tag {tag}", ts)
    m = run.get("metrics")
    if m:
        lines += ["", f"Server metrics during the run ({m['server']}):"]
        for key in (
            "prefix_hits_by_tier",
            "prefix_queries_by_tier",
            "bytes_read_by_tier",
            "bytes_written_by_tier",
            "restore_seconds_by_tier",
            "restore_decisions",
            "recomputed_tokens",
            "preemptions",
            "tier_errors",
        ):
            if key in m and m[key] not in (None, {}):
                lines.append(f"- {key}: {_fmt_metric(m[key])}")
    lines.append("")
    return lines


def _fmt_metric(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt_metric(x)}" for k, x in sorted(v.items()))
    if isinstance(v, float):
        return f"{v:.4g}" if not v.is_integer() else str(int(v))
    return str(v)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# kvtier bench: {result['workload']} ({result['scenario']})", ""]
    lines.append(
        f"Target: {result['target']}. Machine: {result['machine']['cpu']}, "
        f"{result['machine']['cores']} cores, {result['machine']['mem_gib']} GiB."
    )
    lines.append(f"Command: `{result['command']}`")
    lines.append("")
    iso = result.get("isolation")
    if iso is not None:
        lines.append(f"**Isolation check: {'PASS' if iso['passed'] else 'FAIL'}**: {iso['detail']}")
        lines.append("")
    sweep = result.get("sweep")
    if sweep:
        lines += [
            "| concurrency | req/s | output tok/s | TTFT p50 ms | TTFT p95 ms | ITL p95 ms | cached % |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in sweep:
            frac = p["cached_fraction"]
            lines.append(
                f"| {p['concurrency']} | {_num(p['requests_per_s'])} | {_num(p['output_tokens_per_s'], '{:.1f}')} | "
                f"{_ms(p['ttft_p50_s'])} | {_ms(p['ttft_p95_s'])} | {_ms(p['itl_p95_s'])} | "
                f"{_num(frac * 100 if frac is not None else None, '{:.1f}')} |"
            )
        lines.append("")
    for name, run in result["runs"].items():
        lines += run_markdown(name, run)
    if result.get("plots"):
        lines += ["Plots: " + ", ".join(f"[{Path(p).name}]({Path(p).name})" for p in result["plots"]), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ plots
def plots(
    result: dict[str, Any], records_by_run: Mapping[str, Sequence[RequestRecord]], out_dir: Path, stem: str
) -> list[str]:
    """TTFT CDF (cold vs warm, every run) and, for a sweep, p50/p95 TTFT vs concurrency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    for i, (name, records) in enumerate(records_by_run.items()):
        for warm, style in ((False, "--"), (True, "-")):
            xs = sorted(r.ttft_s * 1e3 for r in records if r.error is None and r.ttft_s is not None and r.warm == warm)
            if not xs:
                continue
            ys = [0.0] + [(k + 1) / len(xs) for k in range(len(xs))]
            ax.step(
                [xs[0]] + xs,
                ys,
                style,
                where="post",
                color=colors[i % len(colors)],
                label=f"{name} {'warm' if warm else 'cold'} (n={len(xs)})",
            )
            drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, client side)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"TTFT CDF: {result['workload']} ({result['scenario']})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"{stem}_ttft_cdf.png"
        fig.savefig(p)
        paths.append(str(p))
    plt.close(fig)
    sweep = result.get("sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [p["concurrency"] for p in sweep]
        ax.plot(xs, [(p["ttft_p50_s"] or 0) * 1e3 for p in sweep], "o-", label="TTFT p50")
        ax.plot(xs, [(p["ttft_p95_s"] or 0) * 1e3 for p in sweep], "s--", label="TTFT p95")
        ax.plot(xs, [(p["itl_p95_s"] or 0) * 1e3 for p in sweep], "^:", label="ITL p95")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel("ms")
        ax.set_title(f"latency vs concurrency: {result['workload']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        p = out_dir / f"{stem}_concurrency.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(str(p))
    return paths
