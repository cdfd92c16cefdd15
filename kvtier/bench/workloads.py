"""Workloads: deterministic generators of sessions of requests (pure Python, no torch).

A workload is a list of `Session`s. A session is a chain of requests sent one after another
(the next one `think_s` after the previous finished); its first request is due at
`arrival_s` after the run starts. A lone request is a session of one.

    session:  arrival_s --> [req 0] --think_s--> [req 1] --think_s--> [req 2]
                                  (sent when due and a concurrency slot is free)

Prompts are token ids drawn from seeded generators (`synth_tokens`), so one seed gives the
same prompts in every process; `render_text` turns them into text for servers that want text.
Every request carries a `prefix_key`: the prefix whose first sight makes a request cold
(None: the harness decides from how much of the prompt it has sent before).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.trace import TraceRecord, as_records, by_time, read_trace

VOCAB = 32000
FIRST_TOKEN = 100
"""Synthetic token ids stay in [FIRST_TOKEN, vocab): clear of special ids."""


@dataclass(slots=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    prefix_key: str | None = None
    """Requests with the same key share a prefix; the first one sent is cold."""
    think_s: float = 0.0
    """Pause after the previous request of the session finished, before this one is sent."""
    tag: str = ""
    """A label the report groups by (e.g. "long" / "short" in the mixed scenario)."""


@dataclass(slots=True)
class Session:
    session_id: str
    requests: list[BenchRequest]
    arrival_s: float = 0.0
    api_key: str | None = None
    """The API key the session's requests are sent with (None: the run's default)."""
    meta: dict = field(default_factory=dict)


# ------------------------------------------------------------------ token synthesis
def _seed_of(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def synth_tokens(seed: int, key: object, n: int, vocab: int = VOCAB) -> list[int]:
    """`n` token ids determined by (seed, key) alone: equal keys give equal tokens."""
    rng = random.Random(_seed_of(seed, key))
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def render_text(tokens: Sequence[int]) -> str:
    """Text for a token list, one pseudo-word per token: equal token prefixes give equal text
    prefixes (for servers driven with text prompts)."""
    n = len(_SYLLABLES)
    return " ".join(_SYLLABLES[t % n] + _SYLLABLES[(t // n) % n] for t in tokens)


def poisson_arrivals(rng: random.Random, n: int, rate: float | None) -> list[float]:
    """`n` arrival times of a Poisson process of `rate` per second (None: all at 0)."""
    if rate is None:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the generated workloads (each workload reads the fields it needs)."""

    seed: int = 0
    vocab_size: int = VOCAB
    output_tokens: int = 16
    """max_tokens of each request (trace replay: capped by it, see `trace_output`)."""
    rate: float | None = None
    """Session arrivals per second (Poisson); None: all sessions arrive at once."""
    # shared system prompt
    num_groups: int = 4
    prompts_per_group: int = 4
    system_tokens: int = 512
    question_tokens: int = 32
    # multi-turn
    num_sessions: int = 4
    turns: int = 4
    user_tokens: int = 64
    reply_tokens: int = 32
    think_time_s: float = 0.2
    # agent
    tool_tokens: int = 512
    branches: int = 2
    shared_steps: int = 1
    step_tokens: int = 64
    # RAG
    doc_pool: int = 8
    docs_per_request: int = 2
    doc_tokens: int = 256
    instruction_tokens: int = 128
    # independent
    num_requests: int = 16
    prompt_tokens: int = 128
    # trace replay
    trace: str | None = None
    block_tokens: int = 512
    """Tokens synthesized per hash id."""
    trace_block_tokens: int = 512
    """Tokens per hash id in the trace itself; input lengths scale by block_tokens / this."""
    speedup: float = 1.0
    limit: int | None = None
    trace_output: bool = False
    """Use the trace's output_length (capped by output_tokens) rather than output_tokens."""


# ------------------------------------------------------------------ workloads
def shared_prefix(c: WorkloadConfig) -> list[Session]:
    """Groups x prompts-per-group: each group shares a system prompt, each prompt adds its own
    question (SGLang's generated-shared-prefix shape); sent in a seeded random order."""
    rng = random.Random(_seed_of(c.seed, "shared_prefix"))
    reqs = []
    for g in range(c.num_groups):
        system = synth_tokens(c.seed, ("system", g), c.system_tokens, c.vocab_size)
        for p in range(c.prompts_per_group):
            q = synth_tokens(c.seed, ("question", g, p), c.question_tokens, c.vocab_size)
            reqs.append(BenchRequest(system + q, c.output_tokens, prefix_key=f"group{g}"))
    rng.shuffle(reqs)
    arrivals = poisson_arrivals(rng, len(reqs), c.rate)
    return [Session(f"sp{i}", [r], a) for i, (r, a) in enumerate(zip(reqs, arrivals))]


def _think(rng: random.Random, mean_s: float) -> float:
    return rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0


def multi_turn(c: WorkloadConfig) -> list[Session]:
    """Chat sessions whose context grows each turn: system + (user, assistant)* + user. The
    assistant replies are synthesized (not the model's output), so prompts are deterministic;
    the server can reuse the previous turn's prompt, not its generated tokens."""
    rng = random.Random(_seed_of(c.seed, "multi_turn"))
    arrivals = poisson_arrivals(rng, c.num_sessions, c.rate)
    sessions = []
    for s in range(c.num_sessions):
        context = synth_tokens(c.seed, ("mt-system", s), c.system_tokens, c.vocab_size)
        reqs = []
        for t in range(c.turns):
            context = context + synth_tokens(c.seed, ("user", s, t), c.user_tokens, c.vocab_size)
            reqs.append(
                BenchRequest(
                    list(context),
                    c.output_tokens,
                    prefix_key=f"session{s}",
                    think_s=_think(rng, c.think_time_s) if t else 0.0,
                )
            )
            context = context + synth_tokens(c.seed, ("reply", s, t), c.reply_tokens, c.vocab_size)
        sessions.append(Session(f"mt{s}", reqs, arrivals[s]))
    return sessions


def agent(c: WorkloadConfig) -> list[Session]:
    """Agent flows: every flow starts from the same tool definitions plus its own task, then
    takes `turns` steps (tool call + tool result appended each step). Each flow branches into
    `branches` sessions that share the first `shared_steps` steps and then diverge."""
    rng = random.Random(_seed_of(c.seed, "agent"))
    tools = synth_tokens(c.seed, "tools", c.tool_tokens, c.vocab_size)
    arrivals = poisson_arrivals(rng, c.num_sessions, c.rate)
    sessions = []
    for f in range(c.num_sessions):
        task = synth_tokens(c.seed, ("task", f), c.user_tokens, c.vocab_size)
        for b in range(c.branches):
            context = tools + task
            reqs = []
            for step in range(c.turns):
                reqs.append(
                    BenchRequest(
                        list(context),
                        c.output_tokens,
                        prefix_key=f"flow{f}",
                        think_s=_think(rng, c.think_time_s) if step else 0.0,
                    )
                )
                key = ("step", f, step) if step < c.shared_steps else ("step", f, b, step)
                context = context + synth_tokens(c.seed, key, c.step_tokens, c.vocab_size)
            sessions.append(Session(f"agent{f}.{b}", reqs, arrivals[f], meta={"flow": f, "branch": b}))
    return sessions


def rag(c: WorkloadConfig) -> list[Session]:
    """Fixed instructions + `docs_per_request` documents drawn from a pool of `doc_pool`
    (Zipf-like popularity, so documents repeat) + a question. Cold: the first request with
    that instruction + first document."""
    rng = random.Random(_seed_of(c.seed, "rag"))
    instructions = synth_tokens(c.seed, "instructions", c.instruction_tokens, c.vocab_size)
    weights = [1.0 / (i + 1) for i in range(c.doc_pool)]
    docs = [synth_tokens(c.seed, ("doc", d), c.doc_tokens, c.vocab_size) for d in range(c.doc_pool)]
    arrivals = poisson_arrivals(rng, c.num_requests, c.rate)
    sessions = []
    for i in range(c.num_requests):
        k = min(c.docs_per_request, c.doc_pool)
        chosen: list[int] = []
        while len(chosen) < k:
            d = rng.choices(range(c.doc_pool), weights)[0]
            if d not in chosen:
                chosen.append(d)
        prompt = list(instructions)
        for d in chosen:
            prompt += docs[d]
        prompt += synth_tokens(c.seed, ("rag-question", i), c.question_tokens, c.vocab_size)
        sessions.append(
            Session(
                f"rag{i}",
                [BenchRequest(prompt, c.output_tokens, prefix_key=f"doc{chosen[0]}")],
                arrivals[i],
                meta={"docs": chosen},
            )
        )
    return sessions


def independent(c: WorkloadConfig) -> list[Session]:
    """Short prompts sharing nothing (distinct first tokens): every request is cold."""
    rng = random.Random(_seed_of(c.seed, "independent"))
    arrivals = poisson_arrivals(rng, c.num_requests, c.rate)
    sessions, firsts = [], set()
    for i in range(c.num_requests):
        prompt = synth_tokens(c.seed, ("independent", i), c.prompt_tokens, c.vocab_size)
        while prompt[0] in firsts:  # no two prompts share even one token of prefix
            prompt[0] = FIRST_TOKEN + (prompt[0] - FIRST_TOKEN + 1) % (c.vocab_size - FIRST_TOKEN)
        firsts.add(prompt[0])
        sessions.append(Session(f"ind{i}", [BenchRequest(prompt, c.output_tokens, prefix_key=f"ind{i}")], arrivals[i]))
    return sessions


def mixed(c: WorkloadConfig) -> list[Session]:
    """Long shared-prefix multi-turn sessions and short independent prompts at once."""
    long = multi_turn(c)
    for s in long:
        for r in s.requests:
            r.tag = "long"
    short = independent(c)
    for s in short:
        for r in s.requests:
            r.tag = "short"
    # interleave so both kinds compete for the concurrency slots from the start
    out: list[Session] = []
    for i in range(max(len(long), len(short))):
        out += long[i : i + 1] + short[i : i + 1]
    return out


# ------------------------------------------------------------------ Mooncake trace replay
def scaled_input_length(input_length: int, block_tokens: int, trace_block_tokens: int) -> int:
    """The input length in synthesized tokens: scaled by block_tokens / trace_block_tokens
    (rounded up; at least one token)."""
    return max(1, math.ceil(input_length * block_tokens / trace_block_tokens))


def trace_prompt(
    hash_ids: Sequence[int], input_length: int, seed: int, block_tokens: int, vocab: int = VOCAB
) -> list[int]:
    """One block of `block_tokens` tokens per hash id (equal ids give equal tokens), the last
    block truncated, or padded with request-unique tokens when input_length is longer."""
    tokens: list[int] = []
    for hid in hash_ids:
        tokens += synth_tokens(seed, ("hash", hid), block_tokens, vocab)
    if len(tokens) >= input_length:
        return tokens[:input_length]
    pad_key = ("pad", tuple(hash_ids), input_length)
    return tokens + synth_tokens(seed, pad_key, input_length - len(tokens), vocab)


def trace(c: WorkloadConfig, records: Sequence[dict | TraceRecord] | None = None) -> list[Session]:
    """Mooncake trace replay: each record is a request due at (timestamp - first) / speedup
    (ms -> s); its prompt is synthesized from its hash ids. Cold/warm: decided by how much of
    the prompt was sent before (prefix_key None). `records`: given instead of `c.trace`."""
    if records is None:
        if not c.trace:
            raise ValueError("the trace workload needs --trace FILE.jsonl (Mooncake format)")
        checked = read_trace(c.trace, c.limit)
    else:
        checked = as_records(records if c.limit is None else list(records)[: c.limit])
    if c.speedup <= 0:
        raise ValueError(f"--speedup must be positive, got {c.speedup}")
    checked = by_time(checked)
    t0 = checked[0].time_ms if checked else 0.0
    sessions = []
    for i, r in enumerate(checked):
        ids = r.hash_ids
        length = scaled_input_length(r.num_tokens(c.trace_block_tokens), c.block_tokens, c.trace_block_tokens)
        out = c.output_tokens
        if c.trace_output and r.output_length:
            out = max(1, min(r.output_length, c.output_tokens))
        prompt = trace_prompt(ids, length, c.seed, c.block_tokens, c.vocab_size)
        arrival = (r.time_ms - t0) / 1000.0 / c.speedup
        sessions.append(
            Session(
                f"trace{i}",
                [BenchRequest(prompt, out)],
                arrival,
                meta={"hash_ids": ids[:4] + (["..."] if len(ids) > 4 else [])},
            )
        )
    return sessions


WORKLOADS: dict[str, Callable[[WorkloadConfig], list[Session]]] = {
    "shared_prefix": shared_prefix,
    "multi_turn": multi_turn,
    "agent": agent,
    "rag": rag,
    "independent": independent,
    "mixed": mixed,
    "trace": trace,
}


def build(name: str, config: WorkloadConfig) -> list[Session]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](config)
