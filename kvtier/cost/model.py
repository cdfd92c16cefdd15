"""The restore-vs-recompute decision.

For a request whose first `d` blocks are on device and whose next blocks sit in lower tiers
(each block in the fastest tier that has it, tiers in order)::

    device  [ d blocks ][ host h1 ][ disk s1 ][ remote r1 ][ ... not stored: recompute ... ]

restoring the first k stored blocks costs

    T_restore(k) = sum over tiers touched: T_lookup + T_queue  +  bytes(k) / read_bw(tier)
                   + bytes(k) / h2d_bw

and leaves T_recompute(tokens after d + k | prefix d + k on device) of prefill. The model picks
the k in 0..K with the least total, so a decision may be partial: restore the first k blocks from
a fast tier and recompute the rest. Tier latency and bandwidth, and the prefill speed, are
moving averages of what was measured, seeded by a short calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class Ema:
    """Exponential moving average; `value` is None until the first sample."""

    __slots__ = ("alpha", "count", "value")

    def __init__(self, alpha: float = 0.2, value: float | None = None) -> None:
        self.alpha = alpha
        self.value = value
        self.count = 0

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.count += 1
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass
class TierSpeed:
    """What reading from one tier costs, measured online."""

    name: str
    lookup_s: Ema = field(default_factory=lambda: Ema(0.2))
    read_bytes_per_s: Ema = field(default_factory=lambda: Ema(0.2))
    job_s: Ema = field(default_factory=lambda: Ema(0.2))
    default_lookup_s: float = 1e-4
    default_bytes_per_s: float = 1e9
    frozen: bool = False
    """Ignore measurements (the simulator pins speeds it was given; its own I/O is no I/O)."""

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0 and not self.frozen:
            self.read_bytes_per_s.update(num_bytes / seconds)

    def observe_lookup(self, seconds: float) -> None:
        if not self.frozen:
            self.lookup_s.update(max(seconds, 0.0))

    def observe_job(self, seconds: float) -> None:
        """Wall time of one load job on this tier (queue estimates)."""
        if not self.frozen:
            self.job_s.update(seconds)

    def read_s(self, num_bytes: int) -> float:
        return num_bytes / self.read_bytes_per_s.get(self.default_bytes_per_s)

    @property
    def latency_s(self) -> float:
        return self.lookup_s.get(self.default_lookup_s)


class PrefillEstimator:
    """Prefill time of n new tokens after a prefix of c tokens:  t = a*n + b*n*(c + n/2).

    `a` is the per-token cost (weights), `b` the per-token-pair attention cost. Fitted online by
    recursive least squares with forgetting, on every step's (tokens, context work, seconds).
    """

    def __init__(self, a: float = 1e-3, b: float = 1e-8, forget: float = 0.98) -> None:
        self.theta = [a, b]
        self.P = [[1e-2, 0.0], [0.0, 1e-10]]
        self.forget = forget
        self.num_samples = 0
        self.frozen = False
        """Pin the estimate (experiments that model a slower or faster accelerator)."""

    @staticmethod
    def features(num_tokens: int, context: int) -> tuple[float, float]:
        return float(num_tokens), float(num_tokens) * (context + num_tokens / 2.0)

    def estimate(self, num_tokens: int, context: int) -> float:
        if num_tokens <= 0:
            return 0.0
        x = self.features(num_tokens, context)
        return max(self.theta[0] * x[0] + self.theta[1] * x[1], 0.0)

    def observe(self, x: tuple[float, float], seconds: float) -> None:
        """One measurement: x = summed features of the step's sequences."""
        if self.frozen:
            return
        P, th, lam = self.P, self.theta, self.forget
        px = [P[0][0] * x[0] + P[0][1] * x[1], P[1][0] * x[0] + P[1][1] * x[1]]
        denom = lam + x[0] * px[0] + x[1] * px[1]
        if denom <= 0:
            return
        k = [px[0] / denom, px[1] / denom]
        err = seconds - (th[0] * x[0] + th[1] * x[1])
        th[0] += k[0] * err
        th[1] += k[1] * err
        th[0] = max(th[0], 0.0)
        th[1] = max(th[1], 0.0)
        self.P = [
            [(P[0][0] - k[0] * px[0]) / lam, (P[0][1] - k[0] * px[1]) / lam],
            [(P[1][0] - k[1] * px[0]) / lam, (P[1][1] - k[1] * px[1]) / lam],
        ]
        self.num_samples += 1


@dataclass(frozen=True, slots=True)
class TierRun:
    """`num_blocks` consecutive blocks that the tier `tier` can restore."""

    tier: str
    num_blocks: int


def take_runs(runs: list[TierRun], num_blocks: int) -> list[TierRun]:
    """The leading `num_blocks` blocks of `runs`, as runs (what a decision restores)."""
    out: list[TierRun] = []
    left = num_blocks
    for run in runs:
        if left <= 0:
            break
        take = min(run.num_blocks, left)
        out.append(TierRun(run.tier, take))
        left -= take
    return out


@dataclass(slots=True)
class RestoreDecision:
    num_blocks: int
    """Stored blocks to restore (a prefix of the runs)."""
    per_tier: dict[str, int]
    t_restore_s: float
    t_recompute_s: float
    """Prefill left after restoring num_blocks."""
    t_all_recompute_s: float
    """Prefill if nothing were restored."""
    kind: str
    """'none' (nothing stored), 'recompute', 'restore' (all stored blocks) or 'partial'."""

    @property
    def t_total_s(self) -> float:
        return self.t_restore_s + self.t_recompute_s


class CostModel:
    """Estimates restoring stored blocks against recomputing them, and picks the cheaper mix.

    Contract:

    - `decide(device_tokens, runs, prompt_tokens)` weighs restoring the first k stored blocks
      of `runs` (in chain order: only a leading part can be restored), for every k from 0 to
      all of them, and returns the k with the least restore + remaining prefill time (the
      smallest such k on a tie; with `restore_all`, every stored block). It only reads.
    - `restore_s(per_tier)`: seconds to load that many blocks from each tier and copy them into
      the device pool; per tier touched, latency + queue wait + bytes / read bandwidth.
    - The speeds are estimates that measurements move: `tiers[name]` (lookup latency, read
      bandwidth, job time), `h2d` (copy into the pool), `prefill` (PrefillEstimator) and
      `queue_s` (set from the tier hierarchy's pending I/O). The hierarchy and the engine feed
      them; `fixed` builds a model whose speeds nothing moves (the simulator's).
    - Only the tiers named at construction exist: a run or count on another raises KeyError.
    """

    def __init__(self, tier_names: list[str], block_bytes: int, block_size: int, h2d_bytes_per_s: float = 1e10) -> None:
        self.tiers = {name: TierSpeed(name) for name in tier_names}
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.h2d = Ema(0.2, h2d_bytes_per_s)
        self.prefill = PrefillEstimator()
        self.queue_s: dict[str, float] = {name: 0.0 for name in tier_names}
        """Expected wait before a new job starts on each tier (set by the I/O scheduler)."""

    @classmethod
    def fixed(
        cls,
        block_bytes: int,
        block_size: int,
        *,
        read_bytes_per_s: dict[str, float],
        latency_s: dict[str, float],
        prefill_s_per_token: float,
        prefill_s_per_token_pair: float = 0.0,
        h2d_bytes_per_s: float = float("inf"),
    ) -> CostModel:
        """A model with given speeds that measurements never move (the simulator's: it has no
        I/O to measure). `h2d_bytes_per_s` infinite: the tier figures are whole restores
        (read + copy into the pool)."""
        cm = cls(list(read_bytes_per_s), block_bytes, block_size, h2d_bytes_per_s)
        for name, bw in read_bytes_per_s.items():
            if bw <= 0 or latency_s[name] < 0:
                raise ValueError(f"tier {name}: need bandwidth > 0 and latency >= 0")
            speed = cm.tiers[name]
            speed.read_bytes_per_s.value = bw
            speed.lookup_s.value = latency_s[name]
            speed.frozen = True
        cm.prefill = PrefillEstimator(a=prefill_s_per_token, b=prefill_s_per_token_pair)
        cm.prefill.frozen = True
        return cm

    def restore_s(self, per_tier: dict[str, int]) -> float:
        t = 0.0
        total = 0
        for name, n in per_tier.items():
            if n <= 0:
                continue
            speed = self.tiers[name]
            t += speed.latency_s + self.queue_s.get(name, 0.0) + speed.read_s(n * self.block_bytes)
            total += n
        return t + total * self.block_bytes / self.h2d.get(1e10)

    def decide(
        self, device_tokens: int, runs: list[TierRun], prompt_tokens: int, restore_all: bool = False
    ) -> RestoreDecision:
        """Best number of stored blocks to restore after `device_tokens` already on device
        (`restore_all`: every stored block, whatever it costs).

        `prompt_tokens` counts every token the request needs computed before its first output
        (the last one is always computed, so runs never cover it).
        """
        bs = self.block_size
        t_all = self.prefill.estimate(prompt_tokens - device_tokens, device_tokens)
        total = sum(r.num_blocks for r in runs)
        if total == 0:
            return RestoreDecision(0, {}, 0.0, t_all, t_all, "none")
        best_k, best_t, best_restore, best_per = 0, t_all, 0.0, {}
        per: dict[str, int] = {}
        k = 0
        for run in runs:
            for _ in range(run.num_blocks):
                k += 1
                per[run.tier] = per.get(run.tier, 0) + 1
                ctx = device_tokens + k * bs
                t_restore = self.restore_s(per)
                t_rest = self.prefill.estimate(prompt_tokens - ctx, ctx)
                if t_restore + t_rest < best_t or (restore_all and k == total):
                    best_k, best_t, best_restore, best_per = k, t_restore + t_rest, t_restore, dict(per)
        if best_k == 0:
            kind = "recompute"
        elif best_k == total:
            kind = "restore"
        else:
            kind = "partial"
        t_left = best_t - best_restore
        return RestoreDecision(best_k, best_per, best_restore, t_left, t_all, kind)
