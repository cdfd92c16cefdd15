"""Prometheus metrics: the only module that turns the engine's stats into Prometheus series.

Two sources:
  * `EngineCollector` renders the engine's EngineStats (kvtier.engine.admin; read at each
    scrape in process, or the engine process's copy fetched for the scrape): cache usage,
    prefix cache queries/hits, preemptions, tier bytes and errors, restore decisions, queue
    lengths;
  * `ServerMetrics.observe_finished` observes the latency histograms (and counts recomputed
    tokens) once per request, when it ends, from its final `RequestOutput`.

Names follow vLLM's under the `kvtier:` prefix, and every series carries vLLM's `model_name`
label (the served model name), so vLLM's Grafana dashboard works with only the prefix changed.
Each app has its own `CollectorRegistry`, so several apps (tests) live in one process.

vLLM's request-level set (all labelled model_name):
    kvtier:prompt_tokens_total / generation_tokens_total   counters, tokens
    kvtier:iteration_tokens_total               histogram of tokens computed per engine step
    kvtier:request_queue_time_seconds / _prefill_time_seconds / _decode_time_seconds /
           _inference_time_seconds              histograms, per request
    kvtier:request_prompt_tokens / _generation_tokens / _max_num_generation_tokens /
           _params_n / _params_max_tokens       histograms, per request
    kvtier:time_per_output_token_seconds        histogram, per token (= inter_token_latency)
    kvtier:request_time_per_output_token_seconds  histogram, per request (decode time / tokens)
    kvtier:cache_config_info                    gauge 1, the cache configuration as labels
    kvtier:gpu_cache_usage_perc                 the device pool's kv_cache_usage_perc (the name
                                                vLLM's dashboard reads)

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

Device queries count prompt tokens matched against the device index; a tier's queries count the
tokens (blocks x block size) asked of it after the device missed, so hits/queries is each tier's
own hit rate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.engine.admin import DriftCounters, EngineStats
from kvtier.outputs import RequestOutput
from kvtier.tiers.hierarchy import TIER_ORDER

PREFIX = "kvtier:"
METRIC_NAMES = ("kvtier", "vllm", "both")
"""--metrics-names: the prefixes /metrics shows (vLLM's `vllm:` for its dashboards and routers)."""
_VLLM_NAMES = re.compile(rb"^((?:# (?:HELP|TYPE) )?)kvtier:", re.MULTILINE)

TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS_S = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
)
RESTORE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)
TPOT_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
PHASE_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


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


class ServerMetrics:
    """The registry of one app: the engine collector plus per-request histograms. `stats`: the
    engine's counters at render time (EngineClient.stats_now, or an EngineAdmin's `stats`).
    Every series carries `model_name`."""

    def __init__(
        self, stats: Callable[[], EngineStats | None], model_name: str = "kvtier", names: str = "both"
    ) -> None:
        if names not in METRIC_NAMES:
            raise ValueError(f"metrics names must be one of {', '.join(METRIC_NAMES)}, got {names!r}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.names = names
        self.registry.register(LabelledCollector(EngineCollector(stats), {"model_name": model_name}))
        r = self.registry
        m = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: list[str] = m) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between the steps that gave a request tokens.", ITL_BUCKETS_S
        )
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Time per output token (vLLM's older name of inter_token_latency_seconds; the same observations).",
            TPOT_BUCKETS_S,
        )
        self.req_tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: decode time divided by the tokens after the first.",
            TPOT_BUCKETS_S,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS_S)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", PHASE_BUCKETS_S)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", PHASE_BUCKETS_S)
        self.decode = hist("request_decode_time_seconds", "First token to last token.", PHASE_BUCKETS_S)
        self.inference = hist("request_inference_time_seconds", "First scheduled to last token.", PHASE_BUCKETS_S)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = hist(
            "request_generation_tokens", "Generated tokens per request (all n samples).", TOKEN_BUCKETS
        )
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens", "The most tokens one of a request's samples generated.", TOKEN_BUCKETS
        )
        self.params_n = hist("request_params_n", "The n of each request.", N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens of each request.", TOKEN_BUCKETS)
        self.restore = hist(
            "restore_seconds",
            "Seconds a request spent restoring KV from tiers "
            "below the device (queue wait included), by the deepest tier it read.",
            RESTORE_BUCKETS_S,
            ["model_name", "tier"],
        )
        self.recomputed = Counter(
            PREFIX + "recomputed_tokens", "Prompt tokens computed rather than reused.", m, registry=r
        )
        self.requests = Counter(
            PREFIX + "request_success",
            "Requests that ended, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
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
        # the series exist (at zero) from the start, as vLLM's do
        for metric in (
            self.ttft,
            self.itl,
            self.tpot,
            self.req_tpot,
            self.e2e,
            self.queue,
            self.prefill,
            self.decode,
            self.inference,
            self.prompt_tokens,
            self.generation_tokens,
            self.max_generation_tokens,
            self.params_n,
            self.params_max_tokens,
            self.recomputed,
        ):
            metric.labels(model_name)

    def note_request(self, request_id: str, max_tokens: int | None) -> None:
        """An engine request's max_tokens, for request_params_max_tokens when it ends (None:
        forget it, the engine refused it)."""
        if max_tokens is None:
            self._max_tokens.pop(request_id, None)
        else:
            self._max_tokens[request_id] = max_tokens

    def observe_finished(self, out: RequestOutput, itl_s: list[float]) -> None:
        """Called once per request when it ends (on the event loop: EngineClient.on_finished)."""
        name = self.model_name
        m = out.metrics
        if m.ttft_s is not None:
            self.ttft.labels(name).observe(m.ttft_s)
        itl, tpot = self.itl.labels(name), self.tpot.labels(name)
        for dt in itl_s:
            itl.observe(dt)
            tpot.observe(dt)
        if m.e2e_s is not None:
            self.e2e.labels(name).observe(m.e2e_s)
        if m.queue_s is not None:
            self.queue.labels(name).observe(m.queue_s)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill.labels(name).observe(m.first_token_time - m.first_scheduled_time)
        lengths = [len(c.token_ids) for c in out.outputs]
        if m.first_token_time is not None and m.finished_time is not None:
            decode_s = m.finished_time - m.first_token_time
            self.decode.labels(name).observe(decode_s)
            if lengths and max(lengths) > 1:
                self.req_tpot.labels(name).observe(decode_s / (max(lengths) - 1))
        if m.first_scheduled_time is not None and m.finished_time is not None:
            self.inference.labels(name).observe(m.finished_time - m.first_scheduled_time)
        self.prompt_tokens.labels(name).observe(len(out.prompt_token_ids))
        self.generation_tokens.labels(name).observe(sum(lengths))
        self.max_generation_tokens.labels(name).observe(max(lengths, default=0))
        self.params_n.labels(name).observe(max(len(out.outputs), 1))
        max_tokens = self._max_tokens.pop(out.request_id, None)
        if max_tokens is not None:
            self.params_max_tokens.labels(name).observe(max_tokens)
        tier = _deepest_tier(out.cached_tokens_by_tier)
        if tier is not None:
            self.restore.labels(name, tier).observe(out.restore_s)
        self.recomputed.labels(name).inc(out.num_recomputed_tokens)
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.requests.labels(name, reason or "abort").inc()
        for c in out.outputs:
            if c.finish_reason == "error":
                self.structured_errors.labels(name, "decode").inc()

    def structured_output_error(self, reason: str) -> None:
        """A structured-outputs constraint refused before it ran (kvtier.server.serving)."""
        self.structured_errors.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The exposition text, under `kvtier:`, `vllm:` or both (`names`): with both, every
        family once per prefix, each family's lines together as the format requires."""
        text = generate_latest(self.registry)
        if self.names == "kvtier":
            return text
        renamed = _VLLM_NAMES.sub(rb"\1vllm:", text)
        return renamed if self.names == "vllm" else text + renamed


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
