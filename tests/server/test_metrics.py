"""The Prometheus collector in process: per-app registries, tier series that follow what the
engine did (host tier hits and bytes, restore decisions, restore seconds by tier), and vLLM
0.32's series under vllm: with its names, types, labels and buckets, valued from what the
engine did."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import LLM, SamplingParams
from kvtier.engine.frontend import make_engine_client
from kvtier.server.app import ServerConfig, build_app
from kvtier.server.metrics import ServerMetrics

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

# vLLM 0.32's series for a single-engine server without LoRA, speculative decoding, KV connector
# or watermarking: what PrometheusStatLogger in vllm/v1/metrics/loggers.py registers (its
# buckets: vllm/v1/metrics/buckets.py; cache_config_info's labels: CacheConfig's fields,
# vllm/config/cache.py, plus engine). name -> (type, labels beside model_name and engine).
# Deliberately left out (vLLM too registers them only when configured for what kvtier does not
# do; kvtier.server.vllm_metrics): num_requests_kv_fetch_by_stage, corrupted_requests,
# watermark_requests, kv_block_lifetime_seconds, kv_block_idle_before_evict_seconds,
# kv_block_reuse_gap_seconds, spec_decode_*, diffusion_*, the KV/EC connectors' series, and
# lora_requests_info (with LoRA on: checked below).
E = ("model_name", "engine")
VLLM_0_32_SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", E),
    "vllm:num_requests_waiting": ("gauge", E),
    "vllm:num_requests_waiting_by_reason": ("gauge", (*E, "reason")),
    "vllm:engine_sleep_state": ("gauge", (*E, "sleep_state")),
    "vllm:kv_cache_usage_perc": ("gauge", E),
    "vllm:prefix_cache_queries": ("counter", E),
    "vllm:prefix_cache_hits": ("counter", E),
    "vllm:external_prefix_cache_queries": ("counter", E),
    "vllm:external_prefix_cache_hits": ("counter", E),
    "vllm:mm_cache_queries": ("counter", E),
    "vllm:mm_cache_hits": ("counter", E),
    "vllm:num_preemptions": ("counter", E),
    "vllm:prompt_tokens": ("counter", E),
    "vllm:prompt_tokens_by_source": ("counter", (*E, "source")),
    "vllm:prompt_tokens_cached": ("counter", E),
    "vllm:prompt_tokens_cached_by_source": ("counter", (*E, "source")),
    "vllm:generation_tokens": ("counter", E),
    "vllm:request_success": ("counter", (*E, "finished_reason")),
    "vllm:admission_rejections": ("counter", ("model_name", "reason")),
    "vllm:estimated_flops_per_gpu": ("counter", E),
    "vllm:estimated_read_bytes_per_gpu": ("counter", E),
    "vllm:estimated_write_bytes_per_gpu": ("counter", E),
    "vllm:request_prompt_tokens": ("histogram", E),
    "vllm:request_generation_tokens": ("histogram", E),
    "vllm:iteration_tokens_total": ("histogram", E),
    "vllm:request_max_num_generation_tokens": ("histogram", E),
    "vllm:request_params_n": ("histogram", E),
    "vllm:request_params_max_tokens": ("histogram", E),
    "vllm:time_to_first_token_seconds": ("histogram", E),
    "vllm:inter_token_latency_seconds": ("histogram", E),
    "vllm:request_time_per_output_token_seconds": ("histogram", E),
    "vllm:e2e_request_latency_seconds": ("histogram", E),
    "vllm:request_queue_time_seconds": ("histogram", E),
    "vllm:request_inference_time_seconds": ("histogram", E),
    "vllm:request_prefill_time_seconds": ("histogram", E),
    "vllm:request_decode_time_seconds": ("histogram", E),
    "vllm:request_num_preemptions": ("histogram", E),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", E),
    "vllm:cache_config_info": ("gauge", ("engine",)),  # plus CacheConfig fields: VLLM_CACHE_CONFIG_FIELDS
}
VLLM_CACHE_CONFIG_FIELDS = {
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "num_gpu_blocks",
    "num_gpu_blocks_override",
    "num_cpu_blocks",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "kv_offloading_size",
    "kv_offloading_backend",
    "prefix_caching_hash_algo",
    "sliding_window",
    "is_attention_free",
}
"""Some of vLLM 0.32's CacheConfig fields (cache_config_info's labels); kvtier shows those it has."""
VLLM_LABEL_VALUES = {
    "finished_reason": {"stop", "length", "abort", "error", "repetition"},
    "source": {
        "vllm:prompt_tokens_by_source": {"local_compute", "local_cache_hit", "external_kv_transfer"},
        "vllm:prompt_tokens_cached_by_source": {"device", "host", "p2p", "disk", "external_unspecified"},
    },
    "reason": {
        "vllm:num_requests_waiting_by_reason": {"capacity", "deferred"},
        "vllm:admission_rejections": {"max_num_queued_reqs", "max_num_queued_tokens"},
    },
    "sleep_state": {"awake", "weights_offloaded", "discard_all"},
}
LATENCY_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
LATENCY_S += (240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TTFT_S += (80.0, 160.0, 640.0, 2560.0)


def vllm_buckets(max_model_len: int | None) -> dict[str, tuple[float, ...]]:
    """vLLM 0.32's default buckets of each histogram; the per-request token counts' (1, 2, 5,
    10, ... up to max_model_len) only given max_model_len."""
    tokens = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= (max_model_len or 0))
    token_counts = (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_max_tokens",
        "request_prefill_kv_computed_tokens",
    )
    return {
        **({f"vllm:{name}": tokens for name in token_counts} if max_model_len else {}),
        "vllm:iteration_tokens_total": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
        "vllm:request_params_n": (1, 2, 5, 10, 20),
        "vllm:request_num_preemptions": (1, 2, 3, 4, 5, 10, 20),
        "vllm:time_to_first_token_seconds": TTFT_S,
        "vllm:inter_token_latency_seconds": ITL_S,
        "vllm:request_time_per_output_token_seconds": ITL_S,
        **{
            f"vllm:{name}": LATENCY_S
            for name in (
                "e2e_request_latency_seconds",
                "request_queue_time_seconds",
                "request_inference_time_seconds",
                "request_prefill_time_seconds",
                "request_decode_time_seconds",
            )
        },
    }


def vllm_sample_names() -> set[str]:
    """The sample names (what a PromQL selector names) of VLLM_0_32_SERIES."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    return {name + s for name, (kind, _) in VLLM_0_32_SERIES.items() for s in suffixes[kind]}


def check_vllm_families(text: str, max_model_len: int | None = None) -> None:
    """The vllm: families of an exposition are VLLM_0_32_SERIES: the same names, types and label
    names, engine="0", the label values vLLM has and vLLM's buckets (those of token counts
    given max_model_len). (The
    text format's *_created families, prometheus_client's creation times, are left out.)"""
    families = {
        f.name: f
        for f in text_string_to_metric_families(text)
        if f.name.startswith("vllm:") and not f.name.endswith("_created")
    }
    assert set(families) == set(VLLM_0_32_SERIES), set(families) ^ set(VLLM_0_32_SERIES)
    buckets = vllm_buckets(max_model_len)
    for name, family in families.items():
        kind, labels = VLLM_0_32_SERIES[name]
        assert family.type == kind, name
        assert family.samples, name
        for s in family.samples:
            names = set(s.labels) - {"le"}
            if name == "vllm:cache_config_info":
                assert names - {"engine"} <= VLLM_CACHE_CONFIG_FIELDS and {"block_size", "num_gpu_blocks"} <= names
            else:
                assert names == set(labels), (name, names)
            assert s.labels.get("engine", "0") == "0", name
        for label, values in VLLM_LABEL_VALUES.items():
            if label in labels:
                want = values if isinstance(values, set) else values[name]
                assert {s.labels[label] for s in family.samples} == want, name
        if name in buckets:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*map(float, buckets[name]), float("inf")], name


def parse(text: bytes) -> dict:
    """{(sample name, sorted labels): value}; the model_name label every series carries is
    checked here and left out of the keys (vLLM's info series have none: cache_config_info,
    lora_requests_info)."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            labels = dict(s.labels)
            no_model = family.name in ("vllm:cache_config_info", "vllm:lora_requests_info")
            assert labels.pop("model_name", None) or no_model, f"{s.name} has no model_name label"
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def prompts(seed: int, n: int, length: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def test_each_app_has_its_own_registry(server_model_dir):
    a = LLM(str(server_model_dir), dtype="float32", num_device_blocks=32, block_size=4)
    b = LLM(str(server_model_dir), dtype="float32", num_device_blocks=48, block_size=4)
    apps = [build_app(make_engine_client(core=llm.engine), llm.tokenizer, ServerConfig()) for llm in (a, b, a)]
    a.generate(prompts(0, 1), SP)
    values = [parse(app.state.metrics.render()) for app in apps]
    q = ("kvtier:prefix_cache_queries_total", (("tier", "device"),))
    assert values[0][q] == values[2][q] == 40 and values[1][q] == 0


def test_tier_series_follow_the_engine(server_model_dir):
    llm = LLM(
        str(server_model_dir),
        dtype="float32",
        num_device_blocks=24,
        block_size=4,
        host_cache_bytes=16 << 20,
        restore_policy="always",
    )
    metrics = ServerMetrics(llm.engine.admin.stats)
    first = prompts(1, 1)[0]
    outs = llm.generate(first, SP)
    outs += llm.generate(prompts(2, 3), SP)  # pushes `first` out of the device pool
    again = llm.generate(first, SP)[0]
    assert again.cached_tokens_by_tier.get("host", 0) > 0 and again.restore_decision == "restore"
    for out in outs + [again]:
        metrics.observe_finished(out, [0.01] * 3)
    m = parse(metrics.render())

    def get(name, **labels):
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    assert get("kvtier:prefix_cache_hits_total", tier="host") >= again.cached_tokens_by_tier["host"]
    assert get("kvtier:prefix_cache_queries_total", tier="host") >= get("kvtier:prefix_cache_hits_total", tier="host")
    assert get("kvtier:tier_bytes_written_total", tier="host") > 0
    assert get("kvtier:tier_bytes_read_total", tier="host") >= 0
    assert get("kvtier:restore_decisions_total", decision="restore") >= 1
    assert get("kvtier:restore_seconds_count", tier="host") == 1
    assert 0 < get("kvtier:host_cache_usage_perc") <= 1
    assert get("kvtier:tier_errors_total", kind="corrupt", tier="host") == 0
    assert get("kvtier:inter_token_latency_seconds_count") == 3 * 5
    assert get("kvtier:recomputed_tokens_total") == sum(o.num_recomputed_tokens for o in outs + [again])
    llm.check_integrity()
    llm.close()


def test_grafana_dashboard_uses_exported_series(server_model_dir):
    import json
    import re
    from pathlib import Path

    llm = LLM(str(server_model_dir), dtype="float32", num_device_blocks=16, block_size=4)
    families = {f.name for f in ServerMetrics(llm.engine.admin.stats).registry.collect()}
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana-kvtier.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|total|count|sum)$", "", m) for e in exprs for m in re.findall(r"kvtier:[a-z0-9_]+", e)}
    assert used and used <= families, used - families


def test_lower_tiers_are_queried_only_after_a_miss_above(server_model_dir, tmp_path):
    """prefix_cache_queries_total by tier: a lower tier is asked only for what the tiers above
    missed, once per admission (a request waiting for space and retrying is no new query; a
    store checking what the disk holds is none): device >= host >= disk, in tokens."""
    llm = LLM(
        str(server_model_dir),
        dtype="float32",
        num_device_blocks=24,
        block_size=4,
        host_cache_bytes=96 << 10,
        disk_cache_dir=str(tmp_path / "disk"),
        disk_cache_bytes=8 << 20,
        restore_policy="always",
        max_num_seqs=4,
    )
    metrics = ServerMetrics(llm.engine.admin.stats)
    shared = prompts(7, 6, length=36)
    for r in range(3):  # revisits under pressure: restores from host and disk, waits for space
        llm.generate(shared[r % 2 :: 2] + prompts(10 + r, 4, length=36), SP)
    llm.engine.tiers.flush(10.0)
    m = parse(metrics.render())
    q = {t: m.get(("kvtier:prefix_cache_queries_total", (("tier", t),)), 0.0) for t in ("device", "host", "disk")}
    h = {t: m.get(("kvtier:prefix_cache_hits_total", (("tier", t),)), 0.0) for t in ("device", "host", "disk")}
    assert q["disk"] > 0 and h["host"] + h["disk"] > 0, (q, h)
    assert q["device"] >= q["host"] >= q["disk"], q
    assert q["host"] <= q["device"] - h["device"], (q, h)  # only what the device missed
    llm.check_integrity()
    llm.close()


def vllm_get(m: dict, name: str, **labels: str) -> float:
    """A vllm: sample of parse(): its engine label is "0"."""
    return m.get((name, tuple(sorted({"engine": "0", **labels}.items()))), 0.0)


def test_vllm_series_are_vllm_0_32s(server_model_dir):
    """Before any request and after some: vLLM's names, types, labels and buckets, all there."""
    llm = LLM(str(server_model_dir), dtype="float32", num_device_blocks=32, block_size=4)
    metrics = ServerMetrics(llm.engine.admin.stats, model_name="tiny", max_model_len=llm.engine.max_model_len)
    check_vllm_families(metrics.render().decode(), llm.engine.max_model_len)
    for out in llm.generate(prompts(3, 2), SP):
        metrics.observe_finished(out, [0.01] * 3)
    check_vllm_families(metrics.render().decode(), llm.engine.max_model_len)
    llm.close()


def test_metrics_names_choose_the_set(server_model_dir):
    llm = LLM(str(server_model_dir), dtype="float32", num_device_blocks=32, block_size=4)
    out = llm.generate(prompts(4, 1), SP)[0]
    for names, prefixes in (("kvtier", {"kvtier"}), ("vllm", {"vllm"}), ("both", {"kvtier", "vllm"})):
        metrics = ServerMetrics(llm.engine.admin.stats, model_name="tiny", names=names)
        metrics.observe_finished(out, [0.01] * 3)
        m = parse(metrics.render())
        assert {name.split(":")[0] for name, _ in m} == prefixes, names
        if "vllm" in prefixes:
            assert vllm_get(m, "vllm:request_success_total", finished_reason="length") == 1
        if "kvtier" in prefixes:
            assert m[("kvtier:request_success_total", (("finished_reason", "length"),))] == 1
    with pytest.raises(ValueError, match="metrics names"):
        ServerMetrics(llm.engine.admin.stats, names="prometheus")
    llm.close()


def test_vllm_prompt_series_follow_the_engine(server_model_dir):
    """Where prompt tokens came from, by vLLM's series: device hits, restores from the host tier,
    computed tokens; a prompt_logprobs request reads no cache. Each request counts once."""
    llm = LLM(
        str(server_model_dir),
        dtype="float32",
        num_device_blocks=24,
        block_size=4,
        host_cache_bytes=16 << 20,
        restore_policy="always",
    )
    metrics = ServerMetrics(llm.engine.admin.stats, max_model_len=llm.engine.max_model_len)
    first = prompts(1, 1)[0]
    outs = llm.generate(first, SP)
    outs += llm.generate(prompts(2, 3), SP)  # pushes `first` out of the device pool
    outs += llm.generate(first, SP)  # restored from the host tier
    outs += llm.generate(first, SP)  # a device hit
    reading = list(outs)
    outs += llm.generate(first, SamplingParams(max_tokens=2, prompt_logprobs=1))  # every position computed
    for out in outs:
        metrics.observe_finished(out, [])
    m = parse(metrics.render())

    def get(name: str, **labels: str) -> float:
        return vllm_get(m, name, **labels)

    cached = {t: sum(o.cached_tokens_by_tier.get(t, 0) for o in outs) for t in ("device", "host", "disk", "remote")}
    assert cached["device"] > 0 and cached["host"] > 0, cached
    num_prompt = sum(len(o.prompt_token_ids) for o in outs)
    num_computed = sum(o.num_recomputed_tokens for o in outs)
    assert get("vllm:prompt_tokens_total") == num_prompt
    assert get("vllm:prompt_tokens_cached_total") == sum(o.num_cached_tokens for o in outs) == num_prompt - num_computed
    assert get("vllm:prefix_cache_hits_total") == cached["device"]
    assert get("vllm:prefix_cache_queries_total") == sum(len(o.prompt_token_ids) for o in reading)
    assert get("vllm:external_prefix_cache_hits_total") == cached["host"]
    assert get("vllm:external_prefix_cache_queries_total") == sum(
        len(o.prompt_token_ids) - o.cached_tokens_by_tier.get("device", 0) for o in reading
    )
    for source, tier in (("device", "device"), ("host", "host"), ("disk", "disk"), ("external_unspecified", "remote")):
        assert get("vllm:prompt_tokens_cached_by_source_total", source=source) == cached[tier], source
    assert get("vllm:prompt_tokens_cached_by_source_total", source="p2p") == 0
    by_source = {
        s: get("vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert by_source == {
        "local_compute": num_computed,
        "local_cache_hit": cached["device"],
        "external_kv_transfer": cached["host"],
    }
    assert get("vllm:request_prefill_kv_computed_tokens_sum") == num_computed
    assert m[("kvtier:request_prefill_kv_computed_tokens_sum", ())] == num_computed
    assert get("vllm:request_prompt_tokens_count") == len(outs)
    assert get("vllm:mm_cache_queries_total") == get("vllm:mm_cache_hits_total") == 0
    assert get("vllm:engine_sleep_state", sleep_state="awake") == 1
    llm.check_integrity()
    llm.close()


def test_vllm_preemption_series(server_model_dir):
    """A pool too small for four growing requests preempts some: num_preemptions_total and
    the per-request histogram count them."""
    llm = LLM(str(server_model_dir), dtype="float32", num_device_blocks=12, block_size=4)
    metrics = ServerMetrics(llm.engine.admin.stats, max_model_len=llm.engine.max_model_len)
    outs = llm.generate(prompts(5, 4, length=8), SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    for out in outs:
        metrics.observe_finished(out, [])
    m = parse(metrics.render())
    preempted = sum(o.num_preemptions for o in outs)
    assert preempted > 0
    assert vllm_get(m, "vllm:num_preemptions_total") == m[("kvtier:num_preemptions_total", ())] == preempted
    assert vllm_get(m, "vllm:request_num_preemptions_sum") == preempted
    assert vllm_get(m, "vllm:request_num_preemptions_count") == len(outs)
    # vLLM's first bucket holds the requests preempted at most once
    at_most_once = sum(o.num_preemptions <= 1 for o in outs)
    assert vllm_get(m, "vllm:request_num_preemptions_bucket", le="1.0") == at_most_once
    llm.check_integrity()
    llm.close()


def test_n_samples_count_as_vllm_counts_them(server_model_dir):
    """One request of n=3: three request_success and request_generation_tokens observations
    (vLLM counts each sample), one of the per-request series."""
    llm = LLM(str(server_model_dir), dtype="float32", num_device_blocks=32, block_size=4)
    metrics = ServerMetrics(llm.engine.admin.stats, max_model_len=llm.engine.max_model_len)
    sp = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    out = llm.generate(prompts(9, 1)[0], sp)[0]
    metrics.note_request(out.request_id, 5)
    metrics.observe_finished(out, [])
    m = parse(metrics.render())
    assert vllm_get(m, "vllm:request_success_total", finished_reason="length") == 3
    assert vllm_get(m, "vllm:request_generation_tokens_count") == 3
    assert vllm_get(m, "vllm:request_generation_tokens_sum") == 15 == vllm_get(m, "vllm:generation_tokens_total")
    assert vllm_get(m, "vllm:request_max_num_generation_tokens_sum") == 5
    assert vllm_get(m, "vllm:request_params_n_sum") == 3
    assert vllm_get(m, "vllm:request_params_max_tokens_sum") == 5
    for name in ("e2e_request_latency_seconds", "request_prompt_tokens", "request_params_n"):
        assert vllm_get(m, f"vllm:{name}_count") == 1, name
    llm.close()


def test_lora_requests_info_only_with_lora(server_model_dir):
    """As vLLM: lora_requests_info exists when LoRA is on (max_lora, the adapters in use)."""
    llm = LLM(str(server_model_dir), dtype="float32", num_device_blocks=32, block_size=4, enable_lora=True, max_loras=2)
    metrics = ServerMetrics(llm.engine.admin.stats, model_name="tiny")
    llm.generate(prompts(6, 1), SP)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (sample,) = families["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert sample.value > 0
    llm.close()


VLLM_DUMP = """
import json, sys
from prometheus_client import REGISTRY
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.metrics.loggers import PrometheusStatLogger

args = EngineArgs(model=sys.argv[1], served_model_name=["tiny"], max_model_len=int(sys.argv[2]), skip_tokenizer_init=True)
logger = PrometheusStatLogger(args.create_engine_config(), [0])
logger.log_engine_initialized()
out = {}
for f in REGISTRY.collect():
    if f.name.startswith("vllm:"):
        labels = sorted({k for s in f.samples for k in s.labels} - {"le"})
        le = [s.labels["le"] for s in f.samples if s.name.endswith("_bucket")]
        out[f.name] = [f.type, labels, le]
print(json.dumps({"version": vllm.__version__, "families": out}))
"""


def test_the_list_is_what_vllm_0_32_registers(server_model_dir):
    """VLLM_0_32_SERIES against vLLM 0.32 itself: its PrometheusStatLogger's families for the
    same model (needs the vLLM environment: scripts/vllm-venv.sh)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    python = os.environ.get("KVTIER_VLLM_PYTHON") or str(Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python")
    if not Path(python).exists():
        pytest.skip("no vLLM environment (scripts/vllm-venv.sh builds .venv-vllm; or set KVTIER_VLLM_PYTHON)")
    run = subprocess.run(
        [python, "-c", VLLM_DUMP, str(server_model_dir), "256"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    dump = json.loads(run.stdout.strip().splitlines()[-1])
    if not dump["version"].startswith("0.32."):
        pytest.skip(f"the list is vLLM 0.32's; the vLLM environment has {dump['version']}")
    families = dump["families"]
    assert set(families) == set(VLLM_0_32_SERIES), set(families) ^ set(VLLM_0_32_SERIES)
    buckets = vllm_buckets(256)
    for name, (kind, labels, le) in families.items():
        assert kind == VLLM_0_32_SERIES[name][0], name
        if name == "vllm:cache_config_info":
            assert set(labels) >= VLLM_CACHE_CONFIG_FIELDS and "engine" in labels
        else:
            assert set(labels) == set(VLLM_0_32_SERIES[name][1]), name
        if kind == "histogram":
            assert [float(b) for b in le] == [*map(float, buckets[name]), float("inf")], name
