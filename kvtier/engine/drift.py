"""KV drift: how far the served next-token distributions move from full-precision KV.

A quantized KV cache (fp8, int8) changes every attention read; the loss in quality is silent
unless someone measures it. Two tools share the math here:

* `kvtier eval-kv` (kvtier.eval.kv_drift): offline, a text file, every KV dtype, over context
  lengths;
* `DriftMonitor`: online, in the engine. A sampled fraction of requests keeps the served
  log-probs of each generated position; when such a request finishes, the same tokens are
  recomputed with full-precision KV and compared::

      served:  prompt --prefill--> [KV in the pool, KV dtype] --decode, decode, ...--> q_t
      shadow:  prompt + output, one prefill from position 0 into a scratch cache in the model
               dtype; a prefill from position 0 attends over its own fresh k/v, never the
               cache, so its distributions p_t use full-precision KV at every position

      per position t:  KL(p_t || q_t) = sum_v p_t(v) (log p_t(v) - log q_t(v)),
                       top-1 agreement = [argmax p_t == argmax q_t]

"Full precision" is the model dtype: the drift measured is what storing KV in the KV dtype
costs, nothing else. The shadow never touches the served pool, the prefix index or the
sampler's generators, so served outputs do not depend on the sample rate. It runs outside any
step's forward pass: queued when the request finishes, computed at the start of the next step
(one request per step), or at the end of the step that finished it when no request is left
(then only that step's own outputs wait). At rate 0 there is no monitor at all.

Which requests: `sample(request_id)` hashes (seed, request id), so a given id is sampled or not
whatever the traffic; the fraction sampled tends to the rate. Which positions: the first
`max_positions` generated tokens of the request's first sample (n > 1 samples and forks are
not tracked). Memory: one float32 vocabulary row per kept position until the request finishes.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from kvtier.config import DriftConfig

if TYPE_CHECKING:
    from kvtier.model.runner import ModelRunner

KL_BUCKETS = (1e-6, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
"""Upper bounds of the per-request mean KL histogram (nats); the last bucket is +Inf."""

_ROW_CHUNK = 64  # rows per float64 divergence pass (bounds memory for large vocabularies)


# -- the math -------------------------------------------------------------------------------------


def divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(ref || test) in nats (float64, >= 0) and top-1 agreement (bool).

    ref_logits, test_logits: [N, vocab] logits (or log-probs) of the same N positions.
    """
    if ref_logits.shape != test_logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref_logits.shape)} vs {tuple(test_logits.shape)}")
    kls, agree = [], []
    for i in range(0, ref_logits.shape[0], _ROW_CHUNK):
        ref = torch.log_softmax(ref_logits[i : i + _ROW_CHUNK].double(), dim=-1)
        test = torch.log_softmax(test_logits[i : i + _ROW_CHUNK].to(ref.device).double(), dim=-1)
        # exp(ref) * (ref - test); 0 * (-inf - x) is nan for tokens the reference rules out
        term = torch.where(ref.isneginf(), torch.zeros_like(ref), ref.exp() * (ref - test))
        kls.append(term.sum(-1).clamp_min(0.0).cpu())
        agree.append((ref.argmax(-1) == test.argmax(-1)).cpu())
    if not kls:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
    return torch.cat(kls), torch.cat(agree)


# -- configuration and stats ------------------------------------------------------------------------


@dataclass
class DriftStats:
    """Running aggregates over every request compared so far (plain numbers: the metrics
    thread reads them at scrape time)."""

    num_samples: int = 0
    """Requests compared."""
    num_tokens: int = 0
    """Generated positions compared."""
    kl_sum: float = 0.0
    """Sum over positions of KL(full || served), nats."""
    kl_max: float = 0.0
    top1_agree: int = 0
    """Positions whose served argmax equals the full-precision argmax."""
    served_nll_sum: float = 0.0
    """Sum of -log q(token) of the tokens served, under the served distributions ..."""
    full_nll_sum: float = 0.0
    """... and under the full-precision ones (their difference: the served tokens' log-prob cost)."""
    num_skipped: int = 0
    """Sampled requests not compared (they ended before generating a token)."""
    shadow_s: float = 0.0
    """Seconds spent in shadow forward passes."""
    kl_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(KL_BUCKETS) + 1))
    """Per-request mean KL, histogram counts (non-cumulative) over KL_BUCKETS + [+Inf] ..."""
    request_kl_sum: float = 0.0
    """... and the sum of those per-request means."""

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.num_tokens if self.num_tokens else 0.0

    @property
    def top1_agreement(self) -> float:
        return self.top1_agree / self.num_tokens if self.num_tokens else 1.0

    def add(self, kl: torch.Tensor, agree: torch.Tensor, served_nll: float, full_nll: float) -> None:
        n = int(kl.numel())
        mean = float(kl.mean()) if n else 0.0
        self.num_samples += 1
        self.num_tokens += n
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()) if n else 0.0)
        self.top1_agree += int(agree.sum())
        self.served_nll_sum += served_nll
        self.full_nll_sum += full_nll
        bucket = next((i for i, b in enumerate(KL_BUCKETS) if mean <= b), len(KL_BUCKETS))
        self.kl_bucket_counts[bucket] += 1
        self.request_kl_sum += mean


# -- the monitor ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Tracked:
    prompt_token_ids: list[int]
    logprobs: list[torch.Tensor] = field(default_factory=list)
    """[vocab] float32 served log-probs of generated position i (on CPU)."""


@dataclass(slots=True)
class _Pending:
    token_ids: list[int]
    """prompt + the generated tokens compared."""
    num_prompt: int
    served: torch.Tensor
    """[num compared, vocab] float32 log-probs."""


class DriftMonitor:
    """Samples requests, keeps their served log-probs, compares at finish (see module doc).

    Engine hooks, in step order: `sample` at admission, `record` after each forward pass,
    `finish` when the request ends (queues the comparison), `run_pending` between steps.
    """

    KL_BUCKETS = KL_BUCKETS
    """The bounds of DriftStats.kl_bucket_counts."""

    def __init__(self, config: DriftConfig, runner: ModelRunner) -> None:
        self.config = config
        self.runner = runner
        self.stats = DriftStats()
        self._tracked: dict[str, _Tracked] = {}
        self._pending: deque[_Pending] = deque()

    def sample(self, request_id: str, prompt_token_ids: list[int]) -> bool:
        """Decide (deterministically) whether to track `request_id`; start tracking if so."""
        if not _sampled(self.config.seed, request_id, self.config.sample_rate):
            return False
        self._tracked[request_id] = _Tracked(list(prompt_token_ids))
        return True

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._tracked

    def record(self, req_id: str, position: int, logits: torch.Tensor) -> None:
        """The served logits [vocab] that chose generated token number `position` (0-based)."""
        t = self._tracked.get(req_id)
        # every generated token of a tracked request passes here once, in order (a preempted
        # request resumes at its next position)
        if t is not None and position == len(t.logprobs) < self.config.max_positions:
            t.logprobs.append(torch.log_softmax(logits.detach().float(), dim=-1).cpu())

    def finish(self, req_id: str, output_token_ids: list[int]) -> None:
        """The request ended (finished or aborted): queue the comparison of what it generated."""
        t = self._tracked.pop(req_id, None)
        if t is None:
            return
        n = min(len(t.logprobs), len(output_token_ids))
        if n == 0:
            self.stats.num_skipped += 1
            return
        self._pending.append(
            _Pending(
                t.prompt_token_ids + list(output_token_ids[:n]), len(t.prompt_token_ids), torch.stack(t.logprobs[:n])
            )
        )

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def run_pending(self, max_items: int | None = None) -> int:
        """Shadow-compute up to `max_items` queued comparisons (all when None); returns how many."""
        done = 0
        while self._pending and (max_items is None or done < max_items):
            self._compare(self._pending.popleft())
            done += 1
        return done

    def _compare(self, p: _Pending) -> None:
        t0 = time.perf_counter()
        # rows num_prompt - 1 .. end - 2 predict the generated tokens 0 .. n - 1
        rows = range(p.num_prompt - 1, len(p.token_ids) - 1)
        full = shadow_logits(self.runner, p.token_ids, list(rows))
        shadow_s = time.perf_counter() - t0
        kl, agree = divergence(full, p.served)
        targets = torch.tensor(p.token_ids[p.num_prompt :])
        full_lp = torch.log_softmax(full.double(), dim=-1)
        served_nll = -float(p.served.double().gather(1, targets[:, None]).sum())
        full_nll = -float(full_lp.gather(1, targets[:, None]).sum())
        # copy, update, swap: a scrape on another thread sees the old or the new aggregates whole
        stats = replace(self.stats, kl_bucket_counts=list(self.stats.kl_bucket_counts))
        stats.add(kl, agree, served_nll, full_nll)
        stats.shadow_s += shadow_s
        self.stats = stats


def _sampled(seed: int, request_id: str, rate: float) -> bool:
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(f"{seed}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < rate


@torch.inference_mode()
def shadow_logits(runner: ModelRunner, token_ids: list[int], rows: list[int]) -> torch.Tensor:
    """float32 logits [len(rows), vocab] at positions `rows` of `token_ids`, computed with
    full-precision KV: one prefill from position 0 (attention over its own fresh k/v) that
    writes into a scratch cache in the model dtype, outside the runner's pool."""
    from kvtier.sched.output import ScheduledSeq

    arch, bs = runner.arch, runner.block_size
    num_blocks = -(-len(token_ids) // bs)
    # one layer's cache: [2, num_kv_heads, num_blocks, block_size, head_dim] (kvtier.model.attention)
    scratch = torch.zeros(
        (arch.num_layers, 2, arch.num_kv_heads, num_blocks, bs, arch.head_dim), dtype=runner.dtype, device=runner.device
    )
    seq = ScheduledSeq(
        req_id="kv-drift-shadow",
        token_ids=list(token_ids),
        start_pos=0,
        block_ids=list(range(num_blocks)),
        sample=False,
    )
    meta = runner.attn_backend.build_metadata([seq], bs, runner.device)
    input_ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    positions = torch.arange(len(token_ids), device=runner.device)
    hidden = runner.model(input_ids, positions, list(scratch.unbind(0)), meta)  # [T, hidden]
    index = torch.tensor(rows, dtype=torch.long, device=runner.device)
    return runner.model.compute_logits(hidden.index_select(0, index)).float().cpu()
