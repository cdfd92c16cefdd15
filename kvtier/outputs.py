"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """'stop', 'length', 'abort', or None while running."""
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
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
    restore_s: float = 0.0
    """Seconds spent loading KV from tiers below the device (queue wait included)."""
    """With tiers: 'none' (nothing stored), 'recompute', 'restore' or 'partial'."""
