"""vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json)
against a live `kvtier serve`, with only the `vllm:` prefix changed to `kvtier:`: every query's
series exists with the dashboard's `model_name` filter, and every rate()/increase() query sees
its series move while requests are served. The queries are the dashboard's PromQL, evaluated
here by what they select (a scrape before and after, parsed by prometheus_client)."""

from __future__ import annotations

import re

import httpx
import pytest
from serverutil import MODEL_NAME, scrape

pytest.importorskip("openai")

DASHBOARD_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]
"""The dashboard's panel queries (its P95/P90/P50 variants differ from P99 only in the quantile)."""

SELECTOR = re.compile(r'vllm:(\w+)\{model_name="\$model_name"\}')

# the rest of vLLM's request-level set, which the dashboard does not chart
MORE_SERIES = [
    "request_inference_time_seconds_count",
    "request_params_n_count",
    "request_params_max_tokens_count",
    "iteration_tokens_total_count",
    "request_time_per_output_token_seconds_count",
]


def _values(samples, name: str, model: str) -> list[float]:
    return [v for (n, labels), v in samples.items() if n == name and dict(labels).get("model_name") == model]


def test_vllm_dashboard_queries_get_data(server):
    before = scrape(server.url, model_name=True)
    client = server.openai()
    for i in range(3):
        client.completions.create(
            model=MODEL_NAME,
            prompt=f"dashboard {i} " * 8,
            max_tokens=6,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    after = scrape(server.url, model_name=True)
    # the dashboard's model_name variable: label_values({__name__=~"vllm:.*"}, model_name)
    assert {dict(labels).get("model_name") for (n, labels) in after if n.startswith("kvtier:")} == {MODEL_NAME}
    for query in DASHBOARD_QUERIES:
        names = SELECTOR.findall(query)
        assert names, query
        moving = "rate(" in query or "increase(" in query
        for name in names:
            series = "kvtier:" + name
            now = _values(after, series, MODEL_NAME)
            assert now, f"no {series} with model_name={MODEL_NAME} for {query!r}"
            if moving:
                was = _values(before, series, MODEL_NAME)
                assert sum(now) > sum(was), f"{series} did not move for {query!r}"
    for name in MORE_SERIES:
        assert sum(_values(after, "kvtier:" + name, MODEL_NAME)) > 0, name
    # by default every series is there under vLLM's own prefix too, with the same value: vLLM's
    # dashboard, alert rules and routers read them unchanged
    for (n, labels), v in after.items():
        if n.startswith("kvtier:") and "_created" not in n:
            twin = after.get(("vllm:" + n.removeprefix("kvtier:"), labels))
            assert twin == v, n
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _values(after, "vllm:" + name, MODEL_NAME), name
    info = [labels for (n, labels) in after if n == "kvtier:cache_config_info"]
    assert info and dict(info[0])["block_size"] == "4"
    # the engine's tier series keep their own labels beside model_name
    queries = {dict(labels)["tier"] for (n, labels), v in after.items() if n == "kvtier:prefix_cache_queries_total"}
    assert "device" in queries


def test_params_histograms_count_what_was_asked(server):
    before = scrape(server.url, model_name=True)
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"prompt": "params", "max_tokens": 7, "n": 3, "temperature": 1.0, "seed": 2},
    )
    assert r.status_code == 200
    after = scrape(server.url, model_name=True)

    def delta(name: str) -> float:
        return sum(_values(after, name, MODEL_NAME)) - sum(_values(before, name, MODEL_NAME))

    assert delta("kvtier:request_params_n_sum") == 3
    assert delta("kvtier:request_params_max_tokens_sum") == 7
    assert delta("kvtier:request_generation_tokens_sum") == r.json()["usage"]["completion_tokens"]
    assert delta("kvtier:generation_tokens_total") == r.json()["usage"]["completion_tokens"]
    assert delta("kvtier:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
