"""The sampler's draw: the distribution it samples is the one asked for (frequencies over many
seeded draws), zero-probability tokens are never drawn, and a seed reproduces its tokens."""

from __future__ import annotations

import torch

from kvtier.model.sampler import SampleRow, _draw, sample
from kvtier.sampling_params import SamplingParams


def test_draw_follows_the_distribution_and_skips_zero_probability_tokens():
    probs = torch.zeros(1000)
    probs[[3, 10, 500, 999]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([_draw(probs, gen) for _ in range(n)]), minlength=1000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {3, 10, 500, 999}
    freq = counts[[3, 10, 500, 999]].double() / n
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.015)


def test_seeded_rows_reproduce_and_greedy_is_argmax():
    logits = torch.randn(3, 5000)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)

    def run():
        rows = [
            SampleRow(0, sp, torch.Generator().manual_seed(7)),
            SampleRow(1, sp, torch.Generator().manual_seed(8)),
            SampleRow(2, SamplingParams(temperature=0.0), None),
        ]
        return [s.token_id for s in sample(logits, rows)]

    a, b = run(), run()
    assert a == b
    assert a[2] == int(logits[2].argmax())
    top50 = set(torch.topk(logits[0], 50).indices.tolist())
    assert a[0] in top50
