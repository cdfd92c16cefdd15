"""vLLM's request-level series (latency and size histograms, request_success), observed once
per request when it ends from its final RequestOutput: `RequestSeries`, one per prefix
(kvtier.server.metrics makes one for kvtier: with kvtier's buckets and one for vllm: with
vLLM 0.32's, kvtier.server.vllm_metrics).

A request's n samples share one prefill and are one request here: one observation each,
except request_success and request_generation_tokens (one per sample, as vLLM counts).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvtier.outputs import RequestOutput
from kvtier.server.vllm_metrics import (
    FINISH_REASONS,
    INTER_TOKEN_LATENCY_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS_S,
    histogram_family,
    request_token_buckets,
)


def _finer(vllm_bounds: tuple[float, ...], up_to: float, extra: tuple[float, ...] = ()) -> tuple[float, ...]:
    """vLLM's bounds up to `up_to`, with the `extra` ones added between them (kvtier's buckets
    are vLLM's, cut short and made finer, so that the two sets of series read alike)."""
    return tuple(sorted({*extra, *(b for b in vllm_bounds if b <= up_to)}))


# kvtier's buckets: vLLM's time-to-first-token buckets up to 80 s; finer than vLLM's below a
# second for the other latencies
TTFT_BUCKETS_S = _finer(TIME_TO_FIRST_TOKEN_BUCKETS_S, 80.0)
ITL_BUCKETS_S = _finer(INTER_TOKEN_LATENCY_BUCKETS_S, 2.5, (0.001, 0.0025, 0.005, 0.015, 0.02, 0.03, 0.04))
E2E_BUCKETS_S = _finer(REQUEST_LATENCY_BUCKETS_S, 120.0, (0.01, 0.05, 0.1))


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class BulkHistogram(Collector):
    """A histogram with constant labels, observed many values at a time (the gaps between a
    request's tokens, when it ends): one bisect per value, without prometheus_client's
    per-observation lock and bookkeeping (several times cheaper per token). Register it in a
    registry to render it."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        """Per bucket, not cumulative; the last for values above every bound."""
        self.sum = 0.0

    def observe_many(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for v in values:
            counts[bisect_left(bounds, v)] += 1  # a value equal to a bound is in that bucket (le)
        self.sum += sum(values)

    def collect(self) -> Iterable[Metric]:
        return [histogram_family(self.name, self.doc, self.labels, self.bounds, self.counts, self.sum)]


@dataclass(frozen=True)
class RequestBuckets:
    """The bucket bounds of RequestSeries' histograms."""

    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    tpot_s: tuple[float, ...]
    e2e_s: tuple[float, ...]
    phase_s: tuple[float, ...]
    """Queue, prefill, decode and inference time."""
    tokens: tuple[float, ...]
    params_n: tuple[float, ...] = REQUEST_PARAMS_N_BUCKETS
    preemptions: tuple[float, ...] = REQUEST_NUM_PREEMPTIONS_BUCKETS

    @classmethod
    def kvtier(cls) -> RequestBuckets:
        """kvtier's buckets: finer than vLLM's below a second (TTFT, ITL, e2e)."""
        return cls(
            TTFT_BUCKETS_S,
            ITL_BUCKETS_S,
            INTER_TOKEN_LATENCY_BUCKETS_S,
            E2E_BUCKETS_S,
            REQUEST_LATENCY_BUCKETS_S,
            TOKEN_BUCKETS,
        )

    @classmethod
    def vllm(cls, max_model_len: int | None) -> RequestBuckets:
        """vLLM 0.32's default buckets (its token counts go up to max_model_len)."""
        tokens = request_token_buckets(max_model_len) if max_model_len else TOKEN_BUCKETS
        return cls(
            TIME_TO_FIRST_TOKEN_BUCKETS_S,
            INTER_TOKEN_LATENCY_BUCKETS_S,
            INTER_TOKEN_LATENCY_BUCKETS_S,
            REQUEST_LATENCY_BUCKETS_S,
            REQUEST_LATENCY_BUCKETS_S,
            tokens,
        )


class RequestSeries:
    """vLLM's request-level series under one prefix with constant labels (model_name, and
    engine for vllm:), observed once per request when it ends (`observe`). The series exist (at
    zero) from the start, as vLLM's do."""

    def __init__(
        self, registry: CollectorRegistry, prefix: str, labels: dict[str, str], buckets: RequestBuckets
    ) -> None:
        names, values = list(labels), list(labels.values())

        def hist(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, names, buckets=bounds, registry=registry).labels(*values)

        b = buckets
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", b.ttft_s)
        self.itl = BulkHistogram(
            prefix + "inter_token_latency_seconds",
            "Time between the steps that gave a request tokens.",
            labels,
            b.itl_s,
        )
        registry.register(self.itl)
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: decode time divided by the tokens after the first (0 with one token).",
            b.tpot_s,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", b.e2e_s)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", b.phase_s)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", b.phase_s)
        self.decode = hist("request_decode_time_seconds", "First token to last token.", b.phase_s)
        self.inference = hist("request_inference_time_seconds", "First scheduled to last token.", b.phase_s)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", b.tokens)
        self.generation_tokens = hist(
            "request_generation_tokens", "Generated tokens per sample (each of a request's n).", b.tokens
        )
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens", "The most tokens one of a request's samples generated.", b.tokens
        )
        self.params_n = hist("request_params_n", "The n of each request.", b.params_n)
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens of each request.", b.tokens)
        self.preemptions = hist("request_num_preemptions", "Times a request was preempted.", b.preemptions)
        self.computed_tokens = hist(
            "request_prefill_kv_computed_tokens", "Prompt tokens computed per request (cached ones left out).", b.tokens
        )
        success = Counter(
            prefix + "request_success",
            "Samples that ended, by finish reason.",
            [*names, "finished_reason"],
            registry=registry,
        )
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}

    def observe(self, out: RequestOutput, itl_s: list[float], max_tokens: int | None) -> None:
        """One request that ended: its final output, the gaps between its token deliveries and
        the max_tokens it asked for (None: not known)."""
        m = out.metrics
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        self.itl.observe_many(itl_s)
        if m.e2e_s is not None:
            self.e2e.observe(m.e2e_s)
        if m.queue_s is not None:
            self.queue.observe(m.queue_s)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        lengths = [len(c.token_ids) for c in out.outputs]
        longest = max(lengths, default=0)
        if m.first_token_time is not None and m.finished_time is not None:
            decode_s = m.finished_time - m.first_token_time
            self.decode.observe(decode_s)
            self.tpot.observe(decode_s / (longest - 1) if longest > 1 else 0.0)
        if m.first_scheduled_time is not None and m.finished_time is not None:
            self.inference.observe(m.finished_time - m.first_scheduled_time)
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        for n in lengths:
            self.generation_tokens.observe(n)
        self.max_generation_tokens.observe(longest)
        self.params_n.observe(max(len(out.outputs), 1))
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
        self.preemptions.observe(out.num_preemptions)
        self.computed_tokens.observe(out.num_recomputed_tokens)
        for reason in [c.finish_reason for c in out.outputs] or [None]:
            self.success[reason if reason in self.success else "abort"].inc()  # None: aborted
