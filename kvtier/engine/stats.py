"""Counters of where prompt tokens came from, kept by the engine (EngineCore.step_stats) and
copied into the metrics scrape's EngineStats (kvtier.engine.admin).

Each request is counted once, when its first sample gets its first token (with
StepStats.num_prompt_tokens), from what its first admission found: by then the restore from
the tiers below the device has finished, and a later re-admission after a preemption does not
count again (as vLLM's prefix_cache_* and prompt_tokens_cached count only a request's first
admission). The n samples of one request share one prefill: they are one request here.

    prompt:   [ device hit | host | disk | remote |   computed   ]
               '-- cached_tokens_by_tier, per tier --' '-- the rest of num_prompt_tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptCacheStats:
    """Prompt tokens by where their KV came from, summed over requests (see the module doc)."""

    num_queried_tokens: int = 0
    """Prompt tokens looked up in the device prefix cache (requests that read it: prefix caching
    on and no prompt_logprobs); vLLM's prefix_cache_queries."""
    num_tier_queried_tokens: int = 0
    """Prompt tokens the device missed, of requests whose admission asked the tiers below;
    vLLM's external_prefix_cache_queries (kvtier's tiers are what vLLM calls external)."""
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """Prompt tokens reused rather than computed, by the tier that held them ("device", "host",
    "disk", "remote"). "device" is vLLM's prefix_cache_hits; the others sum to its
    external_prefix_cache_hits."""

    def count(self, num_prompt_tokens: int, cached_by_tier: dict[str, int], looked_up: bool, tiers_asked: bool) -> None:
        """One request at its first token: its prompt length, what its first admission reused
        by tier (Request.cached_by_tier), whether it read the device prefix cache and whether
        its admission asked the tiers below."""
        device = cached_by_tier.get("device", 0)
        if looked_up:
            self.num_queried_tokens += num_prompt_tokens
        if tiers_asked:
            self.num_tier_queried_tokens += num_prompt_tokens - device
        by_tier = self.cached_tokens_by_tier
        for tier, n in cached_by_tier.items():
            if n:
                by_tier[tier] = by_tier.get(tier, 0) + n

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens reused from any tier (vLLM's prompt_tokens_cached)."""
        return sum(self.cached_tokens_by_tier.values())

    def copy(self) -> PromptCacheStats:
        """A copy to read while the engine thread goes on counting (a dict it grows meanwhile is
        copied again)."""
        for _ in range(10):
            try:
                by_tier = dict(self.cached_tokens_by_tier)
                break
            except RuntimeError:
                continue
        else:
            by_tier = {}
        return PromptCacheStats(self.num_queried_tokens, self.num_tier_queried_tokens, by_tier)


@dataclass
class LoRACounters:
    """With LoRA on: the adapters of the running and waiting requests (vLLM's
    lora_requests_info)."""

    max_loras: int
    running: list[str] = field(default_factory=list)
    """Names of the adapters some running request uses, sorted."""
    waiting: list[str] = field(default_factory=list)
    """Names of the adapters some waiting (or loading) request uses, sorted."""
    time_s: float = 0.0
    """Wall-clock time (Unix seconds) of this copy: the value vLLM's gauge carries."""
