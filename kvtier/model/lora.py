"""LoRA adapters in the forward pass: y = base(x) + scale * (x A^T) B^T for each projection an
adapter targets, each adapter on the rows (tokens) of its own sequences only.

An adapter's weights, per layer and fused projection (the loader fuses q|k|v and gate|up, see
kvtier.model.llama), as kvtier.lora builds them from a PEFT checkpoint:

    A  [R, K]   the parts' A matrices stacked (R = the sum of the parts' ranks)
    B  [N, R]   block diagonal: the output rows of part p meet only p's rank columns;
                each part's scale (alpha / r, or alpha / sqrt(r) with rslora) folded in

so a fused projection costs two small GEMMs per adapter, not two per part. B's zero blocks add
exact zeros: the sums are those of the parts' own products.

A step's rows (all sequences' tokens, flattened in sequence order) are grouped by adapter:

    rows     [ seq 0: adapter a ][ seq 1: base ][ seq 2: adapter b ][ seq 3: adapter a ]
    groups   a: rows of seq 0 and seq 3 (an index tensor), b: the rows of seq 2 (a slice)

Each group multiplies its rows only and adds the product into them: in place on a slice of the
output where the rows are contiguous, else gathered (index_select) and scattered (index_add_).
The base model's rows cost nothing, and a step without adapters never builds a LoRABatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""kvtier's projections of a decoder layer, in the order of `LoRAWeights.layers[i]`."""
QKV, O_PROJ, GATE_UP, DOWN = range(len(PROJECTIONS))

LayerWeights = list[tuple[torch.Tensor, torch.Tensor] | None]
"""One layer's (A, B) per projection (PROJECTIONS order); None where the adapter leaves it."""


@dataclass(slots=True, eq=False)
class LoRAWeights:
    """One adapter, ready for the forward pass (in the model dtype).

    `key` names its content (a digest of its files, kvtier.lora): equal keys mean equal weights,
    so it is what the scheduler counts slots by and what the block keys of its KV are salted
    with. `max_rank`: its largest rank of any part."""

    key: bytes
    name: str
    max_rank: int
    layers: list[LayerWeights]

    def to(self, device: torch.device) -> LoRAWeights:
        """These weights on `device` (itself when they are there already)."""
        first = next((ab[0] for layer in self.layers for ab in layer if ab is not None), None)
        if first is None or first.device == device:
            return self
        layers: list[LayerWeights] = [
            [None if ab is None else (ab[0].to(device), ab[1].to(device)) for ab in layer] for layer in self.layers
        ]
        return LoRAWeights(self.key, self.name, self.max_rank, layers)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for ab in layer if ab is not None for a, b in [ab])


Rows = slice | torch.Tensor
"""A group's rows of the step: a slice where they are contiguous, else a long index tensor."""


class LoRABatch:
    """One step's adapters and the rows each applies to; built by `build` for steps where at
    least one row has an adapter, and passed down DecoderLM.forward to every projection."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[tuple[LoRAWeights, Rows]]) -> None:
        self.groups = groups

    @staticmethod
    def build(
        adapters: Sequence[LoRAWeights | None], num_tokens: Sequence[int], device: torch.device
    ) -> LoRABatch | None:
        """Sequence i has `num_tokens[i]` rows, in order, and runs `adapters[i]` (None: the base
        model). None when no sequence has an adapter."""
        spans: dict[bytes, tuple[LoRAWeights, list[tuple[int, int]]]] = {}
        start = 0
        for adapter, n in zip(adapters, num_tokens, strict=True):
            if adapter is not None and n:
                entry = spans.get(adapter.key)
                if entry is None:
                    spans[adapter.key] = (adapter, [(start, start + n)])
                elif entry[1][-1][1] == start:  # follows its previous sequence: one span
                    entry[1][-1] = (entry[1][-1][0], start + n)
                else:
                    entry[1].append((start, start + n))
            start += n
        if not spans:
            return None
        groups: list[tuple[LoRAWeights, Rows]] = []
        for adapter, ranges in spans.values():
            if len(ranges) == 1:
                groups.append((adapter, slice(*ranges[0])))
                continue
            index = torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in ranges])
            groups.append((adapter, index.to(device)))
        return LoRABatch(groups)

    def apply(self, layer: int, projection: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += (x A^T) B^T on each group's rows, for the adapters that target this layer's
        `projection` (PROJECTIONS index); x [T, K] is the projection's input, out [T, N] its
        base output (a fresh tensor, updated in place). Returns out."""
        for adapter, rows in self.groups:
            ab = adapter.layers[layer][projection]
            if ab is None:
                continue
            a, b = ab  # [R, K], [N, R]
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ a.t(), b.t())
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return out
