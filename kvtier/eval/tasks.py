"""Task accuracy per KV dtype: multiple choice by log-likelihood, on items kvtier generates itself.

KL and top-1 agreement (kvtier.eval.kv_drift) say how far a KV dtype moves the next-token
distribution; this says whether it changes answers. The task is in-context retrieval, which is
what a KV cache is for: a list of facts, then a question about one of them,

    The code for Lima is 4821. The code for Oslo is 7312. ... (n facts)
    Question: what is the code for Oslo? Answer: The code for Oslo is  [7312 | 4821 | 9034 | 1156]

with the distractors drawn from the other facts of the list. Every item is generated from a seed
(no download). An answer is right when its choice has the highest sum of token log-probabilities.

For each item and KV dtype, the context is prefilled once into the paged pool (KV written in the
dtype, attention over what the cache holds, as in serving); each choice then runs as one chunk
over that cached context in a copy of the context's last, partial block (the scheduler's
copy-on-write), so choices never see each other's tokens and one context serves all of them.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

CITIES = [
    "Lima",
    "Oslo",
    "Cairo",
    "Quito",
    "Dakar",
    "Hanoi",
    "Kyiv",
    "Riga",
    "Sofia",
    "Tunis",
    "Accra",
    "Baku",
    "Bern",
    "Doha",
    "Lagos",
    "Minsk",
    "Paris",
    "Rome",
    "Seoul",
    "Tokyo",
    "Vienna",
    "Warsaw",
    "Zagreb",
    "Athens",
    "Berlin",
    "Dublin",
    "Havana",
    "Lisbon",
    "Madrid",
    "Manila",
    "Nairobi",
    "Ottawa",
    "Prague",
    "Santiago",
    "Sydney",
    "Taipei",
    "Tbilisi",
    "Vilnius",
    "Yerevan",
    "Bogota",
    "Caracas",
    "Jakarta",
    "Kampala",
    "Lusaka",
    "Muscat",
    "Nicosia",
    "Reykjavik",
    "Tallinn",
    "Amman",
    "Beirut",
    "Brussels",
    "Helsinki",
    "Kigali",
    "Luanda",
    "Maputo",
    "Rabat",
    "Skopje",
    "Tirana",
    "Valletta",
    "Windhoek",
]


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    answer: int
    """Index of the right choice."""


def retrieval_items(num_items: int, num_facts: int = 40, num_choices: int = 4, seed: int = 0) -> list[Item]:
    """In-context retrieval items (see the module docstring), deterministic in `seed`."""
    if not 2 <= num_choices <= num_facts <= len(CITIES):
        raise ValueError(f"need 2 <= num_choices <= num_facts <= {len(CITIES)}")
    rng = random.Random(seed)
    items = []
    for _ in range(num_items):
        cities = rng.sample(CITIES, num_facts)
        codes = rng.sample(range(1000, 10000), num_facts)
        facts = " ".join(f"The code for {c} is {n}." for c, n in zip(cities, codes))
        asked = rng.randrange(num_facts)
        others = rng.sample([i for i in range(num_facts) if i != asked], num_choices - 1)
        order = [asked, *others]
        rng.shuffle(order)
        context = f"{facts}\nQuestion: what is the code for {cities[asked]}? Answer: The code for {cities[asked]} is"
        items.append(Item(context, tuple(f" {codes[i]}" for i in order), order.index(asked)))
    return items


@dataclass
class TaskRow:
    kv_dtype: str
    num_items: int
    accuracy: float
    agreement: float
    """Fraction of items where the KV dtype picks the reference KV's choice."""
    mean_context_tokens: float
    reference: bool = False


@dataclass
class TaskResult:
    config: dict[str, Any]
    rows: list[TaskRow] = field(default_factory=list)
    seconds_by_kv_dtype: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "seconds_by_kv_dtype": self.seconds_by_kv_dtype,
            "rows": [asdict(r) for r in self.rows],
        }


def evaluate_tasks(
    model: str,
    kv_dtypes: list[str],
    *,
    num_items: int = 64,
    num_facts: int = 40,
    seed: int = 0,
    dtype: str = "float32",
    block_size: int = 16,
    log=None,
) -> TaskResult:
    """Accuracy of the reference KV (the model dtype) and of each of `kv_dtypes` on the same items."""
    from kvtier.model.tokenizer import Tokenizer

    tok = Tokenizer(model)
    items = retrieval_items(num_items, num_facts=num_facts, seed=seed)
    encoded = [(tok.encode(it.context), [tok.encode(c, add_special_tokens=False) for c in it.choices]) for it in items]
    result = TaskResult(
        config={
            "model": model,
            "dtype": dtype,
            "num_items": num_items,
            "num_facts": num_facts,
            "seed": seed,
            "block_size": block_size,
            "kv_dtypes": kv_dtypes,
            "task": "in-context retrieval, 4 choices, sum log-likelihood",
        }
    )
    picks: dict[str, list[int]] = {}
    for kv in ["auto", *kv_dtypes]:
        t0 = time.perf_counter()
        picks[kv] = _choices(model, kv, encoded, dtype, block_size)
        result.seconds_by_kv_dtype[kv] = round(time.perf_counter() - t0, 2)
        if log:
            log(f"KV {kv}: {result.seconds_by_kv_dtype[kv]} s")
    mean_ctx = sum(len(c) for c, _ in encoded) / len(encoded)
    for kv, chosen in picks.items():
        acc = sum(c == it.answer for c, it in zip(chosen, items)) / len(items)
        agree = sum(a == b for a, b in zip(chosen, picks["auto"])) / len(items)
        result.rows.append(
            TaskRow(dtype if kv == "auto" else kv, len(items), acc, agree, mean_ctx, reference=kv == "auto")
        )
    return result


def _choices(
    model: str, kv_dtype: str, encoded: list[tuple[list[int], list[list[int]]]], dtype: str, block_size: int
) -> list[int]:
    """The chosen index per item with KV dtype `kv_dtype`."""
    from kvtier.model.runner import ModelRunner
    from kvtier.sched.output import BlockCopy, ScheduledSeq, SchedulerOutput

    bs = block_size
    ctx_blocks = max(-(-len(c) // bs) for c, _ in encoded)
    choice_blocks = max(-(-(bs + max(len(x) for x in ch)) // bs) for _, ch in encoded)
    runner = ModelRunner(
        model, dtype=dtype, block_size=bs, num_blocks=ctx_blocks + choice_blocks, seed=0, kv_cache_dtype=kv_dtype
    )
    chosen = []
    for ctx, choices in encoded:
        shared = len(ctx) - 1  # the last context token runs with each choice: its logits score the first
        table = list(range(-(-len(ctx) // bs)))
        runner.execute(SchedulerOutput(seqs=[ScheduledSeq("ctx", ctx[:shared], 0, table, False)]))
        full = shared // bs
        scores = []
        for choice in choices:
            own = list(range(ctx_blocks, ctx_blocks + -(-(shared % bs + len(choice)) // bs)))
            copies = [BlockCopy(table[full], own[0], shared % bs)] if shared % bs else []
            tokens = [ctx[-1], *choice[:-1]]
            logits = runner.execute(
                SchedulerOutput(
                    seqs=[ScheduledSeq("c", tokens, shared, table[:full] + own, True)], block_copies=copies
                ),
                all_rows=True,
            )
            lp = torch.log_softmax(logits.double(), dim=-1)
            scores.append(float(lp[torch.arange(len(choice)), torch.tensor(choice)].sum()))
        chosen.append(max(range(len(scores)), key=scores.__getitem__))
    del runner
    gc.collect()
    return chosen


def format_table(result: TaskResult) -> str:
    cfg = result.config
    lines = [
        f"task: {cfg['task']}; {cfg['num_items']} items of {cfg['num_facts']} facts "
        f"(~{result.rows[0].mean_context_tokens:.0f} context tokens), model {cfg['model']} ({cfg['dtype']})",
        f"{'kv_dtype':<14} {'accuracy':>9} {'agrees with reference':>22}",
    ]
    for r in result.rows:
        lines.append(f"{r.kv_dtype + ('*' if r.reference else ''):<14} {r.accuracy:>9.3f} {r.agreement:>22.3f}")
    lines.append("* reference KV (the model dtype)")
    return "\n".join(lines)
