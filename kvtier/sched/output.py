"""The contract between the scheduler and the model runner.

One `SchedulerOutput` per engine step is the only thing the runner reads. It names, for every
scheduled sequence, the tokens to compute this step and where their KV goes::

    request tokens:  |<-------- start_pos -------->|<--- token_ids --->|
                     [ KV already in the pool      ][ computed now      ]
    block_ids:       [ b0 ][ b1 ][ b2 ] ...  covers start_pos + len(token_ids) tokens

`block_copies` are token-granular prefix reuse: copy the first `num_tokens` slots of `src` into
`dst` (every layer, K and V) before the forward pass. `block_loads` are blocks restored from a
tier below, written into the pool before the forward pass too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.kvcache.block_pool import BlockCopy, BlockLoad

if TYPE_CHECKING:
    from kvtier.model.lora import LoRAWeights

__all__ = ["BlockCopy", "BlockLoad", "ScheduledSeq", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    req_id: str
    token_ids: list[int]
    """Tokens whose KV is computed (and written) this step."""
    start_pos: int
    """Position of token_ids[0]; equals the tokens already in the pool for this sequence."""
    block_ids: list[int]
    """The sequence's block table; covers at least start_pos + len(token_ids) tokens."""
    sample: bool
    """True when the last of token_ids needs logits (prompt done, or decoding)."""
    lora: LoRAWeights | None = None
    """The LoRA adapter its tokens run through (kvtier.model.lora); None: the base model."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """What one engine step computes: made by `Scheduler.schedule()` on the engine thread and
    read, on the same thread, by the model runner (copies, loads, one forward pass over `seqs`)
    and by `Scheduler.update_from_output`. Read-only once built.

    Invariants: each request appears at most once in `seqs`; every block a copy, a load or a
    sequence names is held by a live request (or locked as a copy source) until
    `KVCacheManager.end_step`; a request in `preempted_req_ids` is not in `seqs`. Empty
    (`is_empty`) when there is nothing to compute, copy or load."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    block_loads: list[BlockLoad] = field(default_factory=list)
    """KV restored from a tier below: written into the pool before the forward pass."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.block_copies and not self.block_loads
