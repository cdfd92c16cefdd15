"""Sampling from logits: vLLM's logits processing (penalties, bias, masks), then greedy,
temperature, top-k, top-p, min-p, seeded, with logprobs.

Rows are independent; each may carry its own `torch.Generator` (a seeded request draws the same
tokens whatever else is in the batch). Logprobs are the model's raw distribution (before
temperature and truncation), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvtier.outputs import Logprob
from kvtier.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    row: int
    """Index into the logits tensor (several SampleRows may read one row: n > 1)."""
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] | None = None
    """The sequence's prompt and output so far: read, not copied (penalties, bad words,
    min_tokens)."""
    output_ids: list[int] | None = None
    eos_ids: tuple[int, ...] = ()
    allowed: torch.Tensor | None = None
    """Structured outputs: a bool mask [vocab] of the tokens the grammar allows next."""
    bias: torch.Tensor | None = None
    """`allowed` as an additive float32 row (`mask_bias`), when the caller made one."""

    @property
    def processed(self) -> bool:
        """Whether this row's logits need `process_row` before temperature and truncation."""
        return self.allowed is not None or self._more_than_grammar

    @property
    def grammar_only(self) -> bool:
        """Only a grammar mask applies (rows like this are masked together, in one op)."""
        return self.allowed is not None and not self._more_than_grammar

    @property
    def _more_than_grammar(self) -> bool:
        sp = self.params
        return sp.processes_logits or (sp.min_tokens > 0 and len(self.output_ids or ()) < sp.min_tokens)


@dataclass(slots=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, Logprob] | None = None


MASKED = -3.0e38
"""What a grammar-refused token's logit becomes in the additive form: below any logit, finite
(so that 0 * it is no NaN), and after temperature and softmax a probability of exactly 0."""


def mask_bias(allowed: torch.Tensor) -> torch.Tensor:
    """A bool mask as an additive float32 tensor: 0 where allowed, MASKED elsewhere. Adding it
    leaves allowed logits exactly as they are; on the CPU this is cheaper than masked_fill with
    -inf over a large vocabulary."""
    return (allowed.to(torch.float32) - 1.0) * -MASKED


def process_row(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """vLLM's logits processing of one row [vocab] (float32, a new tensor): the grammar's mask
    (structured outputs), min_tokens masking,
    logit_bias, allowed_token_ids, bad_words, then repetition, frequency and presence penalties."""
    sp = row.params
    logits = logits.float().clone()
    vocab = logits.numel()
    if row.allowed is not None:  # the grammar first, as vLLM applies its bitmask
        logits.masked_fill_(~row.allowed[:vocab], float("-inf"))
    out_ids = row.output_ids or []
    if sp.min_tokens and len(out_ids) < sp.min_tokens:
        stops = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            stops.update(row.eos_ids)
        in_vocab = [t for t in stops if 0 <= t < vocab]
        if in_vocab:
            logits[in_vocab] = float("-inf")
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), dtype=torch.long)
        logits.index_add_(0, ids, torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype))
    if sp.allowed_token_ids:
        keep = torch.full_like(logits, float("-inf"))
        ids = torch.tensor(sp.allowed_token_ids, dtype=torch.long)
        keep[ids] = logits[ids]
        logits = keep
    if sp.bad_words_token_ids:
        banned = bad_words_index(sp).banned(out_ids)
        if banned:
            logits[banned] = float("-inf")
    if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
        counts = (
            torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=vocab)[:vocab]
            if out_ids
            else torch.zeros(vocab, dtype=torch.long)
        )
        if sp.repetition_penalty != 1.0:
            seen = counts > 0
            if row.prompt_ids:
                seen[torch.tensor(row.prompt_ids, dtype=torch.long)] = True
            rp = sp.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        if sp.frequency_penalty:
            logits -= sp.frequency_penalty * counts.to(logits.dtype)
        if sp.presence_penalty:
            logits -= sp.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def tokenize_bad_words(words: Iterable[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each distinct word, stripped of leading space,
    encoded as is and with one leading space; empty and repeated sequences dropped. One pass:
    two encodes per distinct word, duplicates found by hashing (no list scan)."""
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    for word in dict.fromkeys(w.lstrip() for w in words):
        for text in (word, " " + word):
            ids = tuple(encode(text))
            if ids and ids not in seen:
                seen.add(ids)
                out.append(list(ids))
    return out


class BadWordsIndex:
    """Bad words' token sequences by what must come before their last token, so that a step
    looks up the output's tail once per distinct prefix length instead of comparing every word:
    `banned(output)` is the tokens that would complete a bad word next."""

    def __init__(self, words: list[list[int]]) -> None:
        self.source = words
        self.always: list[int] = sorted({w[0] for w in words if len(w) == 1})
        self.by_prefix: dict[tuple[int, ...], set[int]] = {}
        for w in words:
            if len(w) > 1:
                self.by_prefix.setdefault(tuple(w[:-1]), set()).add(w[-1])
        self.prefix_lengths = sorted({len(p) for p in self.by_prefix})

    def banned(self, output: list[int]) -> list[int]:
        out = set(self.always)
        for n in self.prefix_lengths:
            if n > len(output):
                break
            last = self.by_prefix.get(tuple(output[len(output) - n :]))
            if last:
                out |= last
        return sorted(out)


def bad_words_index(sp: SamplingParams) -> BadWordsIndex:
    """`sp.bad_words_token_ids` indexed, built once per SamplingParams (kept in its __dict__,
    which asdict and replace do not copy; rebuilt if the list is replaced)."""
    words = sp.bad_words_token_ids or []
    index = sp.__dict__.get("_bad_words_index")
    if index is None or index.source is not words:
        index = sp.__dict__["_bad_words_index"] = BadWordsIndex(words)
    return index


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
    uniform, so a zero-probability token is never drawn. On the CPU this is much cheaper than
    torch.multinomial over a large vocabulary, which had been a visible share of a serving
    engine's time."""
    if gen is not None and gen.device != probs.device:
        probs = probs.cpu()
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=gen, dtype=torch.float64, device=cdf.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


def top_logprobs(lp: torch.Tensor, token_id: int, k: int | None) -> dict[int, Logprob]:
    """token id -> Logprob for the `k` most likely tokens of the log-softmax row `lp` and for
    `token_id` (vLLM's shape: rank 1 is the most likely; the chosen token comes first)."""
    value = float(lp[token_id])
    out = {token_id: Logprob(value, int((lp > value).sum()) + 1)}
    if k:
        vals, ids = torch.topk(lp, k)
        for rank, (tid, v) in enumerate(zip(ids.tolist(), vals.tolist()), start=1):
            out.setdefault(tid, Logprob(v, rank))
    return out


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
    """Pick one token per SampleRow from `logits` [num_rows, vocab] (float32)."""
    if not rows:
        return []
    out: list[Sample | None] = [None] * len(rows)
    processed = {i: process_row(logits[r.row], r) for i, r in enumerate(rows) if r.processed and not r.grammar_only}
    masked = [i for i, r in enumerate(rows) if r.grammar_only]
    if masked:  # the grammar's masks of all such rows in one op (a new tensor: logits stay as they are)
        idx = torch.tensor([rows[i].row for i in masked], device=logits.device)
        vocab = logits.shape[-1]
        sub = logits.index_select(0, idx).float()
        biases = [b for i in masked if (b := rows[i].bias) is not None]
        if len(biases) == len(masked):
            sub.add_(torch.stack([b[:vocab] for b in biases]))
        else:  # grammar_only rows all have a mask
            masks = [a for i in masked if (a := rows[i].allowed) is not None]
            sub.masked_fill_(~torch.stack([a[:vocab] for a in masks]), float("-inf"))
        for i, t in zip(masked, sub.argmax(dim=-1).tolist()):
            if rows[i].params.greedy:
                out[i] = Sample(t)
        processed.update((i, row) for i, row in zip(masked, sub.unbind(0)) if out[i] is None)
    for i, row in processed.items():
        if rows[i].params.greedy and out[i] is None:
            out[i] = Sample(int(row.argmax()))
    greedy = [i for i, r in enumerate(rows) if r.params.greedy and out[i] is None and i not in processed]
    if greedy:
        idx = torch.tensor([rows[i].row for i in greedy], device=logits.device)
        tokens = logits.index_select(0, idx).argmax(dim=-1).tolist()
        for i, t in zip(greedy, tokens):
            out[i] = Sample(t)
    for i, r in enumerate(rows):
        if out[i] is not None:
            continue
        row = processed[i] if i in processed else logits[r.row]
        probs = torch.softmax(_filter(row, r.params), dim=-1)
        out[i] = Sample(_draw(probs, r.generator))
    samples: list[Sample] = []
    for s in out:
        assert s is not None  # every row was picked above
        samples.append(s)
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want_lp:
        lp = torch.log_softmax(logits.float(), dim=-1)
        for i in want_lp:
            r, s = rows[i], samples[i]
            row = lp[r.row]
            s.logprob = float(row[s.token_id])
            s.top_logprobs = top_logprobs(row, s.token_id, r.params.logprobs)
    return samples
