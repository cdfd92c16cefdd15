"""vLLM 0.32's Prometheus series, with its names, types, labels and buckets, computed from what
kvtier's engine does: what vLLM's Grafana dashboards, alert rules and KV-aware routers read.

vLLM's set is what its V1 engine's PrometheusStatLogger registers (vllm/v1/metrics/loggers.py,
buckets from vllm/v1/metrics/buckets.py) for a single-engine server: every series carries
`model_name` (the served name) and `engine="0"`, except cache_config_info (the cache config
as labels, plus engine), admission_rejections (model_name, reason) and lora_requests_info
(max_lora, waiting_lora_adapters, running_lora_adapters), as in vLLM.

From the engine's EngineStats (rendered at scrape time by `VllmEngineCollector`):
    num_requests_running / _waiting        gauges; waiting counts the requests waiting for KV
                                           from a tier below too (vLLM: for its KV connector)
    num_requests_waiting_by_reason         reason=capacity (waiting to be admitted) | deferred
                                           (waiting for KV from a tier below)
    engine_sleep_state                     sleep_state=awake 1, weights_offloaded 0,
                                           discard_all 0 (kvtier has no sleep mode)
    kv_cache_usage_perc                    fraction of device blocks in use
    prefix_cache_queries / _hits           prompt tokens looked up in / found in the device
                                           prefix cache, at each request's first admission
    external_prefix_cache_queries / _hits  the same for the tiers below (host, disk, remote):
                                           tokens the device missed / tokens restored
    prompt_tokens_cached                   prompt tokens reused from any tier
    prompt_tokens_cached_by_source         source=device | host | disk | external_unspecified
                                           (the remote tier) | p2p (0: no instance-to-instance
                                           transfer)
    prompt_tokens, prompt_tokens_by_source source=local_compute | local_cache_hit (device) |
                                           external_kv_transfer (tiers below)
    generation_tokens, num_preemptions     counters
    iteration_tokens_total                 histogram of tokens computed per engine step
    mm_cache_queries / _hits               0 (kvtier serves text models)
    estimated_flops_per_gpu / _read_bytes_per_gpu / _write_bytes_per_gpu
                                           0, as vLLM without --enable-mfu-metrics
    cache_config_info                      1; labels: the vLLM CacheConfig fields kvtier has
                                           (block_size, cache_dtype, enable_prefix_caching,
                                           num_gpu_blocks, kv_offloading_size: the host tier in
                                           GiB) and engine
    lora_requests_info                     only with LoRA on, as vLLM: the adapters in use as
                                           labels, the time of the scrape as value
Per request (kvtier.server.request_metrics.RequestSeries, observed when a request ends): the
latency and size histograms and request_success (by finished_reason, all five of vLLM's
reasons present from the start); admission_rejections is 0 (kvtier has no queue limits).

vLLM counts each of a request's n samples as an engine request; kvtier runs them as one
request with one prefill. So here one request is one observation, except request_success and
request_generation_tokens (one per sample, as vLLM) and request_max_num_generation_tokens /
request_params_n (one per request, as vLLM).

Not exposed, as vLLM exposes them only when configured for something kvtier does not do:
num_requests_kv_fetch_by_stage (a KV-consumer connector), corrupted_requests
(VLLM_COMPUTE_NANS_IN_LOGITS), watermark_requests (watermarking), kv_block_lifetime_seconds /
_idle_before_evict_seconds / _reuse_gap_seconds (--kv-cache-metrics), spec_decode_* and
diffusion_* (speculative decoding, diffusion models), the KV/EC connectors' own series, and
tool_call_parser_invocations (the API server's tool parser counter, not the engine's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvtier.engine.admin import EngineStats

VLLM_PREFIX = "vllm:"
ENGINE = "0"
"""The `engine` label of a single-engine vLLM server."""

# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS_S = (
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
TIME_TO_FIRST_TOKEN_BUCKETS_S = (
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
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS_S = (
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
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's finished_reason values (every one has a request_success series from the start)."""
ADMISSION_REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
CACHE_HIT_SOURCES = {"device": "device", "host": "host", "p2p": None, "disk": "disk", "external_unspecified": "remote"}
"""vLLM's prompt_tokens_cached_by_source sources and the kvtier tier each one counts (None:
none; kvtier's remote tier is a shared store, vLLM's "external_unspecified")."""
SLEEP_STATES = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


def histogram_family(
    name: str, doc: str, labels: dict[str, str], bounds: Iterable[float], counts: Iterable[int], total: float
) -> HistogramMetricFamily:
    """One histogram series with constant labels from counts kept per bucket (not cumulative,
    the last for values above every bound), as kvtier keeps them: cheaper to add to than
    Prometheus' cumulative ones, summed up once at scrape time."""
    buckets, running = [], 0
    for bound, n in zip([*map(floatToGoString, bounds), "+Inf"], counts):
        running += n
        buckets.append((bound, running))
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), buckets, total)
    return family


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets of per-request token counts: 1, 2, 5, 10, 20, ... up to max_model_len."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class VllmEngineCollector(Collector):
    """vLLM's engine-level series from the engine's EngineStats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        es = self.stats()
        return [] if es is None else list(vllm_engine_families(es, self.model_name))


def vllm_engine_families(es: EngineStats, model_name: str) -> Iterable[Metric]:
    """vLLM's engine-level families from one EngineStats."""
    base = ["model_name", "engine"]
    values = [model_name, ENGINE]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=base)
        family.add_metric(values, value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=base)
        family.add_metric(values, value)
        return family

    def by_label(kind: type, name: str, doc: str, label: str, by: dict[str, float]) -> Metric:
        family = kind(VLLM_PREFIX + name, doc, labels=[*base, label])
        for key, value in by.items():
            family.add_metric([*values, key], value)
        return family

    yield gauge("num_requests_running", "Requests in the running batch.", es.num_running)
    yield gauge(
        "num_requests_waiting",
        "Requests waiting to run (for admission, or for their KV from a tier below).",
        es.num_waiting + es.num_loading,
    )
    yield by_label(
        GaugeMetricFamily,
        "num_requests_waiting_by_reason",
        "Waiting requests by reason: capacity (waiting for admission) or deferred (waiting "
        "for their KV from a tier below); they sum to num_requests_waiting.",
        "reason",
        {"capacity": es.num_waiting, "deferred": es.num_loading},
    )
    yield by_label(
        GaugeMetricFamily,
        "engine_sleep_state",
        "Engine sleep state (kvtier does not sleep: always awake).",
        "sleep_state",
        dict(SLEEP_STATES),
    )
    yield gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (1 means full).", es.kv_usage)

    pc = es.prompt_cache
    cached = pc.cached_tokens_by_tier
    device = cached.get("device", 0)
    lower = pc.num_cached_tokens - device
    yield counter(
        "prefix_cache_queries",
        "Prompt tokens looked up in the device prefix cache (first admission of each request).",
        pc.num_queried_tokens,
    )
    yield counter("prefix_cache_hits", "Prompt tokens found in the device prefix cache.", device)
    yield counter(
        "external_prefix_cache_queries",
        "Prompt tokens the device missed, looked up in the tiers below (host, disk, remote).",
        pc.num_tier_queried_tokens,
    )
    yield counter("external_prefix_cache_hits", "Prompt tokens restored from the tiers below the device.", lower)
    yield counter("mm_cache_queries", "Multi-modal cache queries (none: text models).", 0)
    yield counter("mm_cache_hits", "Multi-modal cache hits (none: text models).", 0)
    yield counter(
        "num_preemptions", "Preemptions (a running request's KV freed, recomputed later).", es.num_preemptions
    )
    yield counter("prompt_tokens", "Prompt tokens of requests that got their first token.", es.num_prompt_tokens)
    yield by_label(
        CounterMetricFamily,
        "prompt_tokens_by_source",
        "Prompt tokens by where their KV came from.",
        "source",
        {
            "local_compute": es.num_prompt_tokens - pc.num_cached_tokens,
            "local_cache_hit": device,
            "external_kv_transfer": lower,
        },
    )
    yield counter("prompt_tokens_cached", "Prompt tokens reused from a cache (any tier).", pc.num_cached_tokens)
    yield by_label(
        CounterMetricFamily,
        "prompt_tokens_cached_by_source",
        "Reused prompt tokens by the tier that held them (external_unspecified: the remote "
        "tier); they sum to prefix_cache_hits + external_prefix_cache_hits.",
        "source",
        {source: cached.get(tier, 0) if tier else 0 for source, tier in CACHE_HIT_SOURCES.items()},
    )
    yield counter("generation_tokens", "Tokens generated.", es.num_generation_tokens)
    yield histogram_family(
        VLLM_PREFIX + "iteration_tokens_total",
        "Tokens per engine step.",
        dict(zip(base, values)),
        es.iteration_token_buckets,
        es.iteration_token_counts,
        es.num_batched_tokens,
    )
    for name in ("flops", "read_bytes", "write_bytes"):
        yield counter(f"estimated_{name}_per_gpu", f"Estimated {name} per GPU (0: not estimated).", 0)
    info = _cache_config_info(es.cache_info)
    family = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info", "The cache configuration.", labels=list(info))
    family.add_metric(list(info.values()), 1)
    yield family
    if es.lora is not None:
        lora = GaugeMetricFamily(
            VLLM_PREFIX + "lora_requests_info",
            "LoRA adapters of the running and waiting requests (value: when this was read).",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        lora.add_metric([str(es.lora.max_loras), ",".join(es.lora.waiting), ",".join(es.lora.running)], es.lora.time_s)
        yield lora


def _cache_config_info(kvtier_info: dict[str, str]) -> dict[str, str]:
    """vLLM's cache_config_info labels that kvtier has, from kvtier's own (EngineStats.cache_info),
    valued as vLLM writes them (str() of the value)."""
    host_bytes = int(kvtier_info.get("host_cache_bytes", "0") or 0)
    return {
        "block_size": kvtier_info["block_size"],
        "cache_dtype": kvtier_info["cache_dtype"],
        "enable_prefix_caching": kvtier_info["enable_prefix_caching"],
        "num_gpu_blocks": kvtier_info["num_gpu_blocks"],
        "kv_offloading_size": str(host_bytes / (1 << 30)) if host_bytes else "None",
        "engine": ENGINE,
    }
