"""The load client: sends a workload's sessions to an OpenAI-compatible server over HTTP
(streaming /v1/completions) and records what each request saw, client side.

One path for every server: kvtier started by the harness, kvtier elsewhere, vLLM, SGLang.
Timing, per request (perf_counter, relative to the run's start)::

    sent_s        first token          token 2 ...        last token   [DONE]
      |--- ttft_s ---|--- itl ---|--- itl ---|  ...  ---|
      |------------------------- e2e_s -----------------|

The first token is the first SSE chunk with a choice; a chunk carrying several tokens spreads its
gap over them (tokens that came with the first one: gap 0). How many tokens a chunk carries comes
from its `token_ids` (the client sends vLLM's `return_token_ids`, which kvtier and vLLM honour),
else from its logprobs (`--stream-logprobs on`), else it counts as one.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.bench.workloads import BenchRequest, Session, render_text
from kvtier.server.sse import aiter_events

PREFIX_GRANULE_TOKENS = 16
"""Granularity at which the client tracks which prompt prefixes it has sent (tokens)."""


@dataclass(slots=True)
class RequestRecord:
    request_index: int
    session_id: str
    turn: int
    tag: str
    tenant: str | None
    """A short hash of the API key it was sent with (None: no key)."""
    scheduled_s: float | None
    """When the workload wanted it sent (the session's arrival, or the previous request's
    finish + think time); sent_s - scheduled_s is the wait for a concurrency slot."""
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    """Mean time per output token after the first: (last - first) / (tokens - 1)."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between streamed tokens."""
    prompt_tokens: int | None = None
    prompt_len: int = 0
    """The prompt's length as sent (tokens, or characters for text prompts)."""
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    seen_prefix_len: int = 0
    """Longest prefix of this prompt this tenant had sent before (whole granules of
    `ClientConfig.prefix_granule` tokens, 4x that in characters for text): what an ideal cache
    could have reused."""
    warm: bool = False
    """Its prefix was sent before (by the same tenant): see `ClientConfig` / `Session`."""
    restore_decision: str | None = None
    num_recomputed_tokens: int | None = None
    restore_s: float | None = None
    server_ttft_s: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClientConfig:
    url: str
    model: str | None = None
    """The `model` field sent; None: the first id of /v1/models."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer` when a session names no key of its own."""
    concurrency: int | None = None
    """Sessions in flight at most (a session holds its slot through its think times);
    None: no limit (arrival times alone pace the run)."""
    text_prompts: bool = False
    """Send prompts as text (`render_text`) rather than token ids."""
    logprobs: bool = False
    """Ask for logprobs=0 (token counts per chunk for servers without `return_token_ids`)."""
    return_token_ids: bool = True
    """Ask for `return_token_ids` (vLLM's extension): exact token counts per chunk."""
    timeout_s: float = 600.0
    progress: bool = True
    temperature: float = 0.0
    ignore_eos: bool = True
    cache_salt: str | None = None
    """Sent as `cache_salt` (kvtier, vLLM): runs with different salts share no KV."""
    prefix_granule: int = PREFIX_GRANULE_TOKENS
    """Tokens per granule of the client's prefix tracking (characters: 4x for text prompts)."""


class PrefixTracker:
    """Which prompt prefixes each tenant has sent: prefix keys, and chained hashes of every
    whole granule of every prompt."""

    def __init__(self, granule_tokens: int = PREFIX_GRANULE_TOKENS) -> None:
        self.granule_tokens = granule_tokens
        self._keys: set[tuple[Any, str]] = set()
        self._chains: set[tuple[Any, bytes]] = set()

    def observe(self, tenant: Any, prompt: Sequence[int] | str, prefix_key: str | None) -> tuple[int, bool]:
        """(longest prefix sent before in prompt units, warm) for this prompt, then remember it.
        Warm: the prefix key was seen before; without a key, at least half the prompt was."""
        granule = self.granule_tokens if not isinstance(prompt, str) else 4 * self.granule_tokens
        h = hashlib.blake2b(digest_size=16)
        chain = []
        for start in range(0, len(prompt) - granule + 1, granule):
            piece = prompt[start : start + granule]
            h.update(piece.encode() if isinstance(piece, str) else repr(list(piece)).encode())
            chain.append(h.copy().digest())
        seen = 0
        for i, digest in enumerate(chain):
            if (tenant, digest) not in self._chains:
                break
            seen = (i + 1) * granule
        if prefix_key is not None:
            warm = (tenant, prefix_key) in self._keys
            self._keys.add((tenant, prefix_key))
        else:
            warm = len(prompt) > 0 and seen * 2 >= len(prompt)
        self._chains.update((tenant, d) for d in chain)
        return seen, warm


def _progress_bar(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)


async def server_info(client: Any) -> dict[str, Any]:
    """The first model of /v1/models ({} when the server does not list any)."""
    try:
        r = await client.get("/v1/models")
        data = r.json().get("data") or []
        return data[0] if data else {}
    except Exception:  # noqa: BLE001 - a server without /v1/models still gets benchmarked
        return {}


async def run_sessions(
    config: ClientConfig, sessions: Sequence[Session], desc: str = "bench", tracker: PrefixTracker | None = None
) -> tuple[list[RequestRecord], float]:
    """Send every session; returns the records (in send order) and the run's wall time.
    `tracker`: what was sent before (to carry cold/warm across runs); default a fresh one."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=config.url.rstrip("/"), timeout=config.timeout_s, limits=limits) as client:
        info = await server_info(client)
        model = config.model or info.get("id")
        logprobs = config.logprobs
        total = sum(len(s.requests) for s in sessions)
        bar = _progress_bar(total, config.progress, desc)
        sem = asyncio.Semaphore(config.concurrency) if config.concurrency else None
        if tracker is None:
            tracker = PrefixTracker(config.prefix_granule)
        records: list[RequestRecord] = []
        t0 = time.perf_counter()

        async def one_session(s: Session) -> None:
            delay = t0 + s.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await drive(s)
            else:
                async with sem:
                    await drive(s)

        async def drive(s: Session) -> None:
            key = s.api_key if s.api_key is not None else config.api_key
            tenant = hashlib.sha256(key.encode()).hexdigest()[:8] if key else None
            due = s.arrival_s
            for turn, req in enumerate(s.requests):
                if turn:
                    await asyncio.sleep(req.think_s)
                    due = time.perf_counter() - t0
                prompt: list[int] | str = render_text(req.prompt) if config.text_prompts else req.prompt
                seen, warm = tracker.observe(key, prompt, req.prefix_key)
                rec = RequestRecord(
                    len(records),
                    s.session_id,
                    turn,
                    req.tag,
                    tenant,
                    due,
                    prompt_len=len(prompt),
                    seen_prefix_len=seen,
                    warm=warm,
                )
                records.append(rec)
                await send(client, rec, req, prompt, key, model, logprobs, t0, config)
                if bar is not None:
                    bar.update(1)

        try:
            await asyncio.gather(*(one_session(s) for s in sessions))
        finally:
            if bar is not None:
                bar.close()
        return records, time.perf_counter() - t0


async def send(
    client: Any,
    rec: RequestRecord,
    req: BenchRequest,
    prompt: list[int] | str,
    api_key: str | None,
    model: str | None,
    logprobs: bool,
    t0: float,
    config: ClientConfig,
) -> None:
    """One streaming completion; fills `rec` (errors go to rec.error, never raised)."""
    import httpx

    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": req.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if config.ignore_eos:
        body["ignore_eos"] = True
    if logprobs:
        body["logprobs"] = 0
    if config.return_token_ids:
        body["return_token_ids"] = True
    if config.cache_salt is not None:
        body["cache_salt"] = config.cache_salt
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    rec.sent_s = start - t0
    last: float | None = None
    first: float | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {text[:300]}"
                return
            done = False
            async for chunk in aiter_events(r):
                now = time.perf_counter()
                if chunk is None:
                    done = True
                    break
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    continue
                choices = chunk.get("choices") or []
                if choices:
                    n_tokens = _chunk_tokens(choices[0])
                    if first is None:
                        first = last = now
                        rec.ttft_s = now - start
                        rec.itl_s.extend([0.0] * (n_tokens - 1))  # tokens that came with the first
                    elif n_tokens:
                        assert last is not None  # set with first
                        rec.itl_s.extend([(now - last) / n_tokens] * n_tokens)
                        last = now
                if chunk.get("usage"):
                    _read_usage(rec, chunk)
            rec.e2e_s = time.perf_counter() - start
            if not done and rec.error is None:
                rec.error = "the stream ended without [DONE]"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return
    n = rec.completion_tokens
    if first is not None and last is not None and n and n > 1:
        rec.tpot_s = (last - first) / (n - 1)


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """Tokens a streamed choice carries: its `token_ids`, else its logprobs, else one (servers
    that stream neither send a chunk per token)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    return 1


def _read_usage(rec: RequestRecord, chunk: dict[str, Any]) -> None:
    u = chunk["usage"]
    rec.prompt_tokens = u.get("prompt_tokens")
    rec.completion_tokens = u.get("completion_tokens")
    details = u.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")
    by_tier = details.get("cached_tokens_by_tier")
    rec.cached_tokens_by_tier = dict(by_tier) if isinstance(by_tier, dict) else None
    extras = chunk.get("kvtier")
    if isinstance(extras, dict):
        rec.restore_decision = extras.get("restore_decision")
        rec.num_recomputed_tokens = extras.get("num_recomputed_tokens")
        rec.restore_s = extras.get("restore_s")
        rec.server_ttft_s = extras.get("ttft_s")
