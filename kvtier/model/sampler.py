"""Sampling from logits: greedy, temperature, top-k, top-p, min-p, seeded, with logprobs.

Rows are independent; each may carry its own `torch.Generator` (a seeded request draws the same
tokens whatever else is in the batch). Logprobs are the model's raw distribution (before
temperature and truncation), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    row: int
    """Index into the logits tensor (several SampleRows may read one row: n > 1)."""
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(slots=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def _filter(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature + truncation of one row [vocab] (float32)."""
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k > 0 and sp.top_k < logits.numel():
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > sp.top_p  # keep the token that crosses p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    return logits


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from `probs` [vocab] by inverse CDF: one uniform from `gen`, a cumulative sum
    (float64) and a binary search; the first token whose cumulative probability exceeds the
    uniform, so a zero-probability token is never drawn. On the CPU this is ~20x faster than
    torch.multinomial over a 32k vocabulary (40 us vs 700-1000 us), which had been 12% of a
    serving engine's time."""
    if gen is not None and gen.device != probs.device:
        probs = probs.cpu()
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=gen, dtype=torch.float64, device=cdf.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
    """Pick one token per SampleRow from `logits` [num_rows, vocab] (float32)."""
    if not rows:
        return []
    out: list[Sample | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        idx = torch.tensor([rows[i].row for i in greedy], device=logits.device)
        tokens = logits.index_select(0, idx).argmax(dim=-1).tolist()
        for i, t in zip(greedy, tokens):
            out[i] = Sample(t)
    for i, r in enumerate(rows):
        if out[i] is not None:
            continue
        probs = torch.softmax(_filter(logits[r.row], r.params), dim=-1)
        out[i] = Sample(_draw(probs, r.generator))
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want_lp:
        lp = torch.log_softmax(logits.float(), dim=-1)
        for i in want_lp:
            r, s = rows[i], out[i]
            row = lp[r.row]
            s.logprob = float(row[s.token_id])
            k = r.params.logprobs
            if k:
                vals, ids = torch.topk(row, k)
                s.top_logprobs = dict(zip(ids.tolist(), vals.tolist()))
                s.top_logprobs.setdefault(s.token_id, s.logprob)
            else:
                s.top_logprobs = {s.token_id: s.logprob}
    return out  # type: ignore[return-value]
