"""SamplingParams, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 is greedy. `n` samples share the prompt's KV blocks. `stop` strings end the
    output (and are not included in it); `stop_token_ids` and EOS end it too unless
    `ignore_eos`. `logprobs=k` returns the top-k log-probabilities of each generated token.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    MAX_N = 128
    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0 \
                or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def child(self, index: int) -> "SamplingParams":
        """Params for the index-th of n parallel samples (its own seed, n=1)."""
        from dataclasses import replace
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
