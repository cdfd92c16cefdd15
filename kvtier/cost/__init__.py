"""Restore-or-recompute: online estimates of tier speed and prefill speed, and the decision.
Pure Python: no torch, no I/O."""

from kvtier.cost.model import CostModel, Ema, PrefillEstimator, RestoreDecision, TierRun, TierSpeed, take_runs

__all__ = ["CostModel", "Ema", "PrefillEstimator", "RestoreDecision", "TierRun", "TierSpeed", "take_runs"]
