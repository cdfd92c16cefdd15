"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.lora import LoRARequest


class Logprob(float):
    """A log-probability that reads both as a float and as vLLM's `Logprob`
    (`.logprob`, `.rank`: 1 for the most likely token; `.decoded_token`: the token's text).
    Plain floats stay valid wherever a Logprob is expected: arithmetic and JSON see a float."""

    __slots__ = ("decoded_token", "rank")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __str__(self) -> str:
        return float.__repr__(self)

    def __reduce__(self):
        return (Logprob, (float(self), self.rank, self.decoded_token))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop', 'length', 'abort', 'error', or None while running."""
    stop_reason: int | str | None = None
    """What ended it: the stop string or stop token id; for finish_reason 'error', why (e.g.
    "structured_outputs: the grammar failed while decoding: ...", short, no backtrace)."""
    logprobs: list[dict[int, Logprob]] | None = None
    """Per generated token: token id -> Logprob, the sampled token and the top-k."""
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    """Prompt tokens whose KV was reused rather than computed."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_recomputed_tokens: int = 0
    """Prompt tokens computed for this request."""
    num_preemptions: int = 0
    restore_decision: str | None = None
    """With tiers: 'none' (nothing stored), 'recompute', 'restore' or 'partial'."""
    restore_s: float = 0.0
    """Seconds spent loading KV from tiers below the device (queue wait included)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt position, the log-probability of the
    prompt's token there (and the top-k), None at position 0 (nothing predicts it)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request ran with (None: the base model), as vLLM's."""
