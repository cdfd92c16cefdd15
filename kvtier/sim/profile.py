"""`kvtier analyze LOG`: a traffic profile that tells whether prefix reuse (and tiering) pays.

Reads, one JSON object per line, any of:
- the server's `--request-log` (prompt_token_ids, arrival_time, output_token_ids),
- token-id lists (a bare JSON list, or {"prompt_token_ids": [...], "timestamp": s}),
- Mooncake trace records (timestamp in ms, input_length, hash_ids: one id per 512-token block),
- OpenAI request bodies ({"prompt": "..."} or {"messages": [...]}) when a tokenizer is given.

Reuse is measured at block granularity (`block_tokens`, 16 by default; 512 for Mooncake), as a
prefix cache sees it: a request reuses the longest run of leading blocks some earlier request
had. Shared segments that do not sit at the start are found by hashing token windows.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.kvcache.keys import block_key, hash_id_key, root_key
from kvtier.trace import json_lines, parse_record

ROOT = root_key(b"kvtier-analyze")
WINDOW = 32  # tokens per window for shared-segment detection
STRIDE = 8  # windows start every STRIDE tokens
MIN_SEGMENT = 64  # a shared segment shorter than this is noise


@dataclass
class Record:
    tokens: list[int] | None
    hash_ids: list[int] | None
    num_tokens: int
    time_s: float | None
    output_tokens: list[int] | None = None


@dataclass
class Profile:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    block_tokens: int = 16
    reusable_prefix_tokens: list[int] = field(default_factory=list)
    reuse_interval_s: list[float] = field(default_factory=list)
    shared_segment_starts: list[int] = field(default_factory=list)
    shared_segment_lengths: list[int] = field(default_factory=list)
    num_multi_turn: int = 0
    num_with_inner_shared_segment: int = 0
    num_reused_blocks: int = 0
    """Distinct blocks hit at least once: what a cache must hold to serve all the reuse."""

    @property
    def ideal_hit_rate(self) -> float:
        return sum(self.reusable_prefix_tokens) / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def multi_turn_ratio(self) -> float:
        return self.num_multi_turn / self.num_requests if self.num_requests else 0.0


def parse_records(lines: Iterable[str], tokenizer: Any = None) -> Iterator[Record]:
    """One Record per non-blank line; ValueError "line N ..." for a line it cannot read."""
    for n, obj in json_lines(lines):
        yield _record(obj, n, tokenizer)


def _record(obj: Any, n: int, tokenizer: Any) -> Record:
    if isinstance(obj, list):
        return Record(_ints(obj, n), None, len(obj), None)
    if not isinstance(obj, dict):
        raise ValueError(f"line {n}: expected an object or a list of token ids")
    t = obj.get("arrival_time", obj.get("timestamp"))
    if "hash_ids" in obj:  # Mooncake: timestamp in milliseconds
        r = parse_record(obj, f"line {n}")
        return Record(None, r.hash_ids, r.input_length or 0, None if t is None else float(t) / 1000.0)
    t = None if t is None else float(t)
    if "prompt_token_ids" in obj:
        toks = _ints(obj["prompt_token_ids"], n)
        outs = obj.get("output_token_ids")
        out = _ints(outs[0], n) if outs and isinstance(outs[0], list) else None
        return Record(toks, None, len(toks), t, out)
    if tokenizer is not None and ("prompt" in obj or "messages" in obj):
        toks = tokenizer.encode(obj["prompt"]) if "prompt" in obj else tokenizer.encode_chat(obj["messages"])
        return Record(toks, None, len(toks), t)
    if "prompt" in obj or "messages" in obj:
        raise ValueError(f"line {n}: a text request needs --tokenizer DIR to be tokenized")
    raise ValueError(f"line {n}: no prompt_token_ids, hash_ids, prompt or messages")


def _ints(xs: Any, n: int) -> list[int]:
    if not isinstance(xs, list) or not all(isinstance(x, int) for x in xs):
        raise ValueError(f"line {n}: expected a list of integers")
    return xs


def analyze(records: Iterable[Record], block_tokens: int | None = None) -> Profile:
    prof: Profile | None = None
    last_seen: dict[bytes, float | None] = {}
    prompt_ends: set[bytes] = set()  # chain key of each earlier prompt's last full block
    windows: dict[int, int] = {}  # window hash -> earliest request index
    reused: set[bytes] = set()
    for i, rec in enumerate(records):
        if prof is None:
            bt = block_tokens or (512 if rec.hash_ids is not None else 16)
            prof = Profile(block_tokens=bt)
        bt = prof.block_tokens
        keys = _chain(rec, bt)
        hit_blocks, interval = 0, None
        for key in keys:
            if key not in last_seen:
                break
            hit_blocks += 1
            t_prev = last_seen[key]
            interval = (rec.time_s - t_prev) if (rec.time_s is not None and t_prev is not None) else None
        hit_tokens = min(hit_blocks * bt, rec.num_tokens)
        prof.num_requests += 1
        prof.num_prompt_tokens += rec.num_tokens
        prof.reusable_prefix_tokens.append(hit_tokens)
        if hit_blocks and interval is not None:
            prof.reuse_interval_s.append(max(interval, 0.0))
        reused.update(keys[:hit_blocks])
        if any(k in prompt_ends for k in keys[:hit_blocks]):
            prof.num_multi_turn += 1
        for key in keys:
            last_seen[key] = rec.time_s
        if keys:
            prompt_ends.add(keys[-1])
        if rec.tokens is not None:
            seg = _longest_shared_segment(rec.tokens, windows, i)
            if seg is not None and seg[1] >= MIN_SEGMENT:
                prof.shared_segment_starts.append(seg[0])
                prof.shared_segment_lengths.append(seg[1])
                if seg[0] > 0 and hit_tokens < seg[0] + seg[1]:
                    prof.num_with_inner_shared_segment += 1
    if prof is not None:
        prof.num_reused_blocks = len(reused)
    return prof or Profile()


def _chain(rec: Record, bt: int) -> list[bytes]:
    keys: list[bytes] = []
    parent = ROOT
    if rec.hash_ids is not None:
        for h in rec.hash_ids:
            parent = hash_id_key(parent, h)
            keys.append(parent)
        return keys
    toks = rec.tokens or []
    for b in range(len(toks) // bt):
        parent = block_key(parent, toks[b * bt : (b + 1) * bt])
        keys.append(parent)
    return keys


def _longest_shared_segment(tokens: list[int], windows: dict[int, int], idx: int) -> tuple[int, int] | None:
    """(start, length) of the longest run of windows this request shares with earlier ones."""
    best: tuple[int, int] | None = None
    run_start = None
    hashes = []
    for pos in range(0, len(tokens) - WINDOW + 1, STRIDE):
        h = hash(tuple(tokens[pos : pos + WINDOW]))
        hashes.append(h)
        seen = windows.get(h)
        if seen is not None and seen < idx:
            if run_start is None:
                run_start = pos
            length = pos + WINDOW - run_start
            if best is None or length > best[1]:
                best = (run_start, length)
        else:
            run_start = None
    for h in hashes:
        windows.setdefault(h, idx)
    return best


def _pct(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else 0.0


def summary(prof: Profile, block_bytes_per_token: int = 12 * 1024) -> dict[str, Any]:
    reuse = [x for x in prof.reusable_prefix_tokens if x > 0]
    out: dict[str, Any] = {
        "requests": prof.num_requests,
        "prompt_tokens": prof.num_prompt_tokens,
        "block_tokens": prof.block_tokens,
        "ideal_hit_rate": round(prof.ideal_hit_rate, 4),
        "requests_with_reuse": len(reuse),
        "distinct_reused_blocks": prof.num_reused_blocks,
        "reusable_prefix_tokens": {"p50": _pct(reuse, 50), "p90": _pct(reuse, 90), "max": max(reuse, default=0)},
        "reuse_interval_s": {
            "p50": round(_pct(prof.reuse_interval_s, 50), 3),
            "p90": round(_pct(prof.reuse_interval_s, 90), 3),
            "count": len(prof.reuse_interval_s),
        },
        "multi_turn_ratio": round(prof.multi_turn_ratio, 4),
        "shared_segment": {
            "requests": len(prof.shared_segment_starts),
            "start_p50": _pct(prof.shared_segment_starts, 50),
            "length_p50": _pct(prof.shared_segment_lengths, 50),
            "not_at_start_and_missed_by_prefix_cache": prof.num_with_inner_shared_segment,
        },
    }
    out["recommendations"] = recommendations(prof, out, block_bytes_per_token)
    return out


def recommendations(prof: Profile, s: dict[str, Any], bytes_per_token: int) -> list[str]:
    recs: list[str] = []
    n = prof.num_requests or 1
    inner = prof.num_with_inner_shared_segment
    if inner >= 0.2 * n and prof.shared_segment_starts:
        starts = [x for x in prof.shared_segment_starts if x > 0]
        common = statistics.mode(starts) if starts else 0
        share = sum(1 for x in starts if x == common) / n
        recs.append(
            f"a shared segment of ~{int(s['shared_segment']['length_p50'])} tokens starts at token "
            f"{common} in {share:.0%} of requests, where a prefix cache cannot reuse it: move it "
            "to the front of the prompt"
        )
    if prof.reuse_interval_s:
        p90 = _pct(prof.reuse_interval_s, 90)
        working = prof.num_reused_blocks * prof.block_tokens * bytes_per_token
        recs.append(
            f"90% of reuse comes within {p90:.0f} s of the previous use: a cache that keeps "
            f"blocks that long covers it; all reused blocks together take {working / 2**30:.1f} GiB "
            f"of KV at {bytes_per_token // 1024} KiB/token, an upper bound for the host tier"
        )
    if s["ideal_hit_rate"] < 0.1:
        recs.append(
            f"the ideal hit rate is only {s['ideal_hit_rate']:.0%}: tiering will not pay for "
            "this traffic unless prompts share more"
        )
    elif s["ideal_hit_rate"] > 0.3:
        recs.append(
            f"the ideal hit rate is {s['ideal_hit_rate']:.0%}: size the device pool and tiers "
            "with `kvtier simulate` on this traffic"
        )
    if prof.multi_turn_ratio > 0.3:
        recs.append(
            f"{prof.multi_turn_ratio:.0%} of requests continue an earlier conversation: keep "
            "conversation KV (write_through to host) rather than recomputing it"
        )
    return recs


def format_text(s: dict[str, Any]) -> str:
    rp, ri, ss = s["reusable_prefix_tokens"], s["reuse_interval_s"], s["shared_segment"]
    lines = [
        f"requests {s['requests']}, prompt tokens {s['prompt_tokens']} (blocks of {s['block_tokens']} tokens)",
        f"ideal hit rate (unlimited cache): {s['ideal_hit_rate']:.1%}",
        f"requests reusing a prefix: {s['requests_with_reuse']} "
        f"(reusable prefix p50 {rp['p50']} tokens, p90 {rp['p90']}, max {rp['max']})",
        f"reuse interval: p50 {ri['p50']} s, p90 {ri['p90']} s",
        f"multi-turn ratio: {s['multi_turn_ratio']:.1%}",
        f"shared segments >= {MIN_SEGMENT} tokens: {ss['requests']} requests, start p50 token {ss['start_p50']}, "
        f"length p50 {ss['length_p50']}; not at the start: {ss['not_at_start_and_missed_by_prefix_cache']}",
        "recommendations:",
    ]
    lines += [f"  - {r}" for r in s["recommendations"]] or ["  - none"]
    return "\n".join(lines)
