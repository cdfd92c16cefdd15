"""Prometheus metrics: the only module that turns the engine's stats into Prometheus series.

Two sets, each in its own registry, shown by /metrics as --metrics-names says (kvtier, vllm
or both):
  * kvtier's, under `kvtier:` (`registry`): vLLM's request-level series under kvtier's prefix
    plus kvtier's own (per tier, restores, drift), every one labelled model_name;
  * vLLM 0.32's, under `vllm:` (`vllm_registry`, kvtier.server.vllm_metrics): vLLM's names,
    types, labels (model_name, engine="0") and buckets, for vLLM's dashboards, alert rules and
    routers.
Each set has two sources:
  * the engine's EngineStats (kvtier.engine.admin; read at each scrape in process, or the
    engine process's copy fetched for the scrape), rendered by `EngineCollector` (kvtier:) and
    `VllmEngineCollector` (vllm:) from one snapshot per render;
  * `RequestSeries` (kvtier.server.request_metrics), observed once per request when it ends
    from its final `RequestOutput` (`ServerMetrics.observe_finished`).
Each app has its own registries, so several apps (tests) live in one process.

kvtier's request-level set (all labelled model_name; the buckets are kvtier's, finer than
vLLM's below a second):
    kvtier:prompt_tokens_total / generation_tokens_total   counters, tokens
    kvtier:iteration_tokens_total               histogram of tokens computed per engine step
    kvtier:request_queue_time_seconds / _prefill_time_seconds / _decode_time_seconds /
           _inference_time_seconds              histograms, per request
    kvtier:request_prompt_tokens / _max_num_generation_tokens / _params_n /
           _params_max_tokens / _num_preemptions / _prefill_kv_computed_tokens
                                                histograms, per request
    kvtier:request_generation_tokens            histogram, per sample (each of n)
    kvtier:request_success_total                finished_reason; per sample
    kvtier:time_per_output_token_seconds        histogram, per token (= inter_token_latency)
    kvtier:request_time_per_output_token_seconds  histogram, per request (decode time / tokens)
    kvtier:cache_config_info                    gauge 1, the cache configuration as labels
    kvtier:gpu_cache_usage_perc                 the device pool's kv_cache_usage_perc (the name
                                                vLLM's older dashboards read)

    series                                      labels          unit
    kvtier:kv_cache_usage_perc                  -               fraction of device blocks in use
    kvtier:host_cache_usage_perc                -               fraction of the host tier's bytes
    kvtier:disk_cache_usage_perc                -               fraction of the disk tier's bytes
    kvtier:tier_usage_bytes / tier_capacity_bytes  tier
    kvtier:prefix_cache_queries_total           tier            tokens looked up in that tier
    kvtier:prefix_cache_hits_total              tier            tokens found there
    kvtier:num_preemptions_total                -
    kvtier:tier_bytes_read_total / _written_total  tier
    kvtier:tier_errors_total                    tier, kind      failed operations; kind=corrupt
                                                                counts entries that failed checks
    kvtier:restore_decisions_total              decision        restore | partial | recompute | none
    kvtier:restore_failures_total               -               restores whose load raised (recomputed)
    kvtier:structured_output_errors_total       reason          constraints not honoured (decode, too_complex, ...)
    kvtier:restore_seconds                      tier            histogram, per request that restored
    kvtier:recomputed_tokens_total              -               prompt tokens computed
    kvtier:time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds
    kvtier:num_requests_running / _waiting / _loading
    kvtier:kv_drift_kl                          -               mean KL(full-precision KV || served),
                                                                nats per compared token (sampled requests)
    kvtier:kv_drift_kl_max                      -               largest KL of one token
    kvtier:kv_drift_top1_agreement              -               fraction of tokens whose argmax agrees
    kvtier:kv_drift_samples_total / _tokens_total  -            requests / tokens compared
    kvtier:kv_drift_request_kl                  -               histogram of per-request mean KL
    kvtier:kv_drift_shadow_seconds_total        -               time spent in shadow forward passes
(the kv_drift series exist only with --kv-drift-sample-rate > 0; see kvtier.engine.drift)

kvtier's device queries count prompt tokens matched against the device index at each
admission; a tier's queries count the tokens (blocks x block size) asked of it after the
device missed, so hits/queries is each tier's own hit rate. (vLLM's prefix_cache_* count each
request's first admission only: kvtier.server.vllm_metrics.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.engine.admin import DriftCounters, EngineStats
from kvtier.outputs import RequestOutput
from kvtier.server.request_metrics import BulkHistogram, RequestBuckets, RequestSeries
from kvtier.server.vllm_metrics import (
    ADMISSION_REJECTION_REASONS,
    ENGINE,
    INTER_TOKEN_LATENCY_BUCKETS_S,
    VLLM_PREFIX,
    VllmEngineCollector,
)
from kvtier.tiers.hierarchy import TIER_ORDER

PREFIX = "kvtier:"
METRIC_NAMES = ("kvtier", "vllm", "both")
"""--metrics-names: the sets /metrics shows (vLLM's `vllm:` for its dashboards and routers)."""

RESTORE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineCollector(Collector):
    """Renders the engine's counters at scrape time: `stats()` gives an EngineStats
    (kvtier.engine.admin) read now (in process) or the engine process's latest copy."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        es = self.stats()
        return [] if es is None else list(engine_families(es))


def engine_families(es: EngineStats) -> Iterable[Metric]:
    """The engine's Prometheus families from one EngineStats."""
    yield _gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (0..1).", es.kv_usage)
    yield _gauge(
        "gpu_cache_usage_perc",
        "The device pool's kv_cache_usage_perc, under the name vLLM's dashboard reads.",
        es.kv_usage,
    )
    yield _counter(
        "prompt_tokens",
        "Prompt tokens of requests that got their first token (cached ones included).",
        es.num_prompt_tokens,
    )
    yield _counter("generation_tokens", "Tokens generated.", es.num_generation_tokens)
    yield _bucket_histogram(
        "iteration_tokens_total",
        "Tokens computed per engine step.",
        tuple(es.iteration_token_buckets),
        es.iteration_token_counts,
        es.num_batched_tokens,
    )
    info = GaugeMetricFamily(
        PREFIX + "cache_config_info", "The cache configuration (value 1).", labels=list(es.cache_info)
    )
    info.add_metric(list(es.cache_info.values()), 1)
    yield info
    for name in ("host", "disk"):
        used, cap = es.tier_usage.get(name, (0, None))
        yield _gauge(
            f"{name}_cache_usage_perc",
            f"Fraction of the {name} tier's bytes in use (0..1; 0 when the tier is off).",
            used / cap if cap else 0.0,
        )
    usage_b = GaugeMetricFamily(PREFIX + "tier_usage_bytes", "Bytes stored in a tier.", labels=["tier"])
    cap_b = GaugeMetricFamily(PREFIX + "tier_capacity_bytes", "Capacity of a tier in bytes.", labels=["tier"])
    for name, (used, cap) in es.tier_usage.items():
        usage_b.add_metric([name], used)
        if cap:
            cap_b.add_metric([name], cap)
    yield usage_b
    yield cap_b

    queries = CounterMetricFamily(
        PREFIX + "prefix_cache_queries",
        "Prompt tokens looked up, by tier (device: all prompts; a tier: after the tiers above missed).",
        labels=["tier"],
    )
    hits = CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found, by tier.", labels=["tier"])
    queries.add_metric(["device"], es.prefix_queries_tokens)
    hits.add_metric(["device"], es.prefix_hits_tokens)
    for name, t in es.tiers.items():
        queries.add_metric([name], t.lookups * es.block_size)
        hits.add_metric([name], t.lookup_hits * es.block_size)
    yield queries
    yield hits

    yield _counter("num_preemptions", "Requests preempted (their KV recomputed later).", es.num_preemptions)
    read = CounterMetricFamily(PREFIX + "tier_bytes_read", "Bytes read from a tier.", labels=["tier"])
    written = CounterMetricFamily(PREFIX + "tier_bytes_written", "Bytes written to a tier.", labels=["tier"])
    errors = CounterMetricFamily(
        PREFIX + "tier_errors",
        "Failed tier operations by kind (kind=corrupt: entries that failed their checks).",
        labels=["tier", "kind"],
    )
    for name, t in es.tiers.items():
        read.add_metric([name], t.bytes_read)
        written.add_metric([name], t.bytes_written)
        for kind, n in sorted(t.errors.items()):
            errors.add_metric([name, kind], n)
        errors.add_metric([name, "corrupt"], t.corrupt)
    yield read
    yield written
    yield errors

    decisions = CounterMetricFamily(
        PREFIX + "restore_decisions", "Restore-or-recompute decisions at admission.", labels=["decision"]
    )
    for kind, n in sorted(es.restore_decisions.items()):
        decisions.add_metric([kind], n)
    yield decisions
    failed = CounterMetricFamily(
        PREFIX + "restore_failures", "Restores whose load failed (their blocks were recomputed; each is logged)."
    )
    failed.add_metric([], es.restore_failures)
    yield failed

    yield _gauge("num_requests_running", "Sequences running.", es.num_running)
    yield _gauge("num_requests_waiting", "Sequences waiting to be admitted.", es.num_waiting)
    yield _gauge("num_requests_loading", "Sequences waiting for KV from a tier below.", es.num_loading)
    if es.drift is not None:
        yield from _drift_metrics(es.drift)


def _drift_metrics(st: DriftCounters) -> Iterable[Metric]:
    """The KV drift monitor's running aggregates."""
    yield _gauge(
        "kv_drift_kl",
        "Mean KL divergence (nats) of served next-token distributions from "
        "full-precision KV ones, over the tokens of sampled requests.",
        st.mean_kl,
    )
    yield _gauge("kv_drift_kl_max", "Largest KL divergence (nats) of one compared token.", st.kl_max)
    yield _gauge(
        "kv_drift_top1_agreement",
        "Fraction of compared tokens whose most likely next token "
        "is the same with served and full-precision KV (1 when none compared yet).",
        st.top1_agreement,
    )
    yield _counter("kv_drift_samples", "Requests shadow-computed with full-precision KV.", st.num_samples)
    yield _counter("kv_drift_tokens", "Generated tokens compared against full-precision KV.", st.num_tokens)
    yield _counter("kv_drift_shadow_seconds", "Seconds spent in full-precision shadow passes.", st.shadow_s)
    counts = list(st.kl_bucket_counts)
    buckets, total = [], 0
    for bound, n in zip([*map(str, st.kl_buckets), "+Inf"], counts):
        total += n
        buckets.append((bound, total))
    yield HistogramMetricFamily(
        PREFIX + "kv_drift_request_kl",
        "Per-request mean KL divergence (nats) from full-precision KV.",
        buckets=buckets,
        sum_value=st.request_kl_sum,
    )


class LabelledCollector(Collector):
    """Another collector's families with constant labels added to every sample (model_name)."""

    def __init__(self, inner: Collector, labels: dict[str, str]) -> None:
        self.inner = inner
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield out


def _bucket_histogram(
    name: str, doc: str, bounds: tuple[float, ...], counts: list[int], total: float
) -> HistogramMetricFamily:
    """A histogram family from per-bucket (not cumulative) counts, the last for +Inf."""
    buckets, running = [], 0
    for bound, n in zip([*map(str, bounds), "+Inf"], counts):
        running += n
        buckets.append((bound, running))
    return HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=total)


class _PinnedStats:
    """The engine's stats for one render: read once and shared by every collector (kvtier's and
    vLLM's show one snapshot); read anew outside a render."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats
        self._pinned: EngineStats | None = None

    def __call__(self) -> EngineStats | None:
        return self._pinned if self._pinned is not None else self._stats()

    @contextmanager
    def pinned(self) -> Iterator[None]:
        self._pinned = self._stats()
        try:
            yield
        finally:
            self._pinned = None


class ServerMetrics:
    """The registries of one app: kvtier's (`registry`: the engine collector, per-request
    series and kvtier's own; the app adds more to it) and vLLM's (`vllm_registry`). `stats`: the
    engine's counters at render time (EngineClient.stats_now, or an EngineAdmin's `stats`);
    `names`: which prefixes /metrics shows (METRIC_NAMES); `max_model_len`: the top of vLLM's
    token-count buckets (None: kvtier's buckets)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        model_name: str = "kvtier",
        names: str = "both",
        max_model_len: int | None = None,
    ) -> None:
        if names not in METRIC_NAMES:
            raise ValueError(f"metrics names must be one of {', '.join(METRIC_NAMES)}, got {names!r}")
        self.model_name = model_name
        self.names = names
        self._stats = _PinnedStats(stats)
        self.registry = CollectorRegistry()
        self.vllm_registry = CollectorRegistry()
        self.registry.register(LabelledCollector(EngineCollector(self._stats), {"model_name": model_name}))
        self.vllm_registry.register(VllmEngineCollector(self._stats, model_name))
        self._series: list[RequestSeries] = []
        if names != "vllm":
            self._series.append(
                RequestSeries(self.registry, PREFIX, {"model_name": model_name}, RequestBuckets.kvtier())
            )
        if names != "kvtier":
            labels = {"model_name": model_name, "engine": ENGINE}
            self._series.append(
                RequestSeries(self.vllm_registry, VLLM_PREFIX, labels, RequestBuckets.vllm(max_model_len))
            )
            rejections = Counter(
                VLLM_PREFIX + "admission_rejections",
                "Requests refused by a queue limit (none: kvtier has no queue limits).",
                ["model_name", "reason"],
                registry=self.vllm_registry,
            )
            for reason in ADMISSION_REJECTION_REASONS:
                rejections.labels(model_name, reason)
        r = self.registry
        m = ["model_name"]
        self.tpot = BulkHistogram(
            PREFIX + "time_per_output_token_seconds",
            "Time per output token (vLLM's older name of inter_token_latency_seconds; the same observations).",
            {"model_name": model_name},
            INTER_TOKEN_LATENCY_BUCKETS_S,
        )
        r.register(self.tpot)
        self.restore = Histogram(
            PREFIX + "restore_seconds",
            "Seconds a request spent restoring KV from tiers "
            "below the device (queue wait included), by the deepest tier it read.",
            ["model_name", "tier"],
            buckets=RESTORE_BUCKETS_S,
            registry=r,
        )
        self.recomputed = Counter(
            PREFIX + "recomputed_tokens", "Prompt tokens computed rather than reused.", m, registry=r
        )
        self.structured_errors = Counter(
            PREFIX + "structured_output_errors",
            "Structured-outputs constraints not honoured, by reason: decode (the grammar failed "
            "while decoding: that choice ended in an error), or why one was refused before it ran "
            "(too_complex, invalid, too_deep, too_large, timeout).",
            ["model_name", "reason"],
            registry=r,
        )
        self._max_tokens: dict[str, int] = {}
        self.recomputed.labels(model_name)

    def note_request(self, request_id: str, max_tokens: int | None) -> None:
        """An engine request's max_tokens, for request_params_max_tokens when it ends (None:
        forget it, the engine refused it)."""
        if max_tokens is None:
            self._max_tokens.pop(request_id, None)
        else:
            self._max_tokens[request_id] = max_tokens

    def observe_finished(self, out: RequestOutput, itl_s: list[float]) -> None:
        """Called once per request when it ends (on the event loop: EngineClient.on_finished)."""
        max_tokens = self._max_tokens.pop(out.request_id, None)
        for series in self._series:
            series.observe(out, itl_s, max_tokens)
        name = self.model_name
        if self.names != "vllm":
            self.tpot.observe_many(itl_s)
        tier = _deepest_tier(out.cached_tokens_by_tier)
        if tier is not None:
            self.restore.labels(name, tier).observe(out.restore_s)
        self.recomputed.labels(name).inc(out.num_recomputed_tokens)
        for c in out.outputs:
            if c.finish_reason == "error":
                self.structured_errors.labels(name, "decode").inc()

    def structured_output_error(self, reason: str) -> None:
        """A structured-outputs constraint refused before it ran (kvtier.server.serving)."""
        self.structured_errors.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The exposition text: kvtier's series, vLLM's or both (`names`), from one snapshot
        of the engine's stats."""
        with self._stats.pinned():
            kvtier = generate_latest(self.registry) if self.names != "vllm" else b""
            vllm = generate_latest(self.vllm_registry) if self.names != "kvtier" else b""
        return kvtier + vllm


def _deepest_tier(by_tier: dict[str, int]) -> str | None:
    deepest = None
    for name in TIER_ORDER:
        if by_tier.get(name):
            deepest = name
    return deepest


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)
