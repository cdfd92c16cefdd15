"""The KV drift monitor's Prometheus series: over real HTTP from `kvtier serve
--kv-drift-sample-rate`, and absent when the monitor is off."""

from __future__ import annotations

import httpx
from serverutil import MODEL_NAME, scrape
from test_metrics import parse

from kvtier import LLM, SamplingParams
from kvtier.server.metrics import ServerMetrics


def drift_series(m: dict) -> dict:
    return {k: v for k, v in m.items() if k[0].startswith("kvtier:kv_drift")}


def test_drift_series_over_http(serve):
    server = serve("--kv-drift-sample-rate", "1", "--kv-cache-dtype", "int8")
    before = scrape(server.url)
    assert before[("kvtier:kv_drift_samples_total", ())] == 0
    assert before[("kvtier:kv_drift_top1_agreement", ())] == 1.0
    tokens = 0
    for prompt in ("the cache keeps what it can", "and drops what it must, in blocks of four"):
        r = httpx.post(
            f"{server.url}/v1/completions",
            timeout=60,
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        tokens += r.json()["usage"]["completion_tokens"]
    m = scrape(server.url)
    assert m[("kvtier:kv_drift_samples_total", ())] == 2
    assert m[("kvtier:kv_drift_tokens_total", ())] == tokens == 10
    assert m[("kvtier:kv_drift_kl", ())] > 0.0  # int8 KV against float32
    assert m[("kvtier:kv_drift_kl_max", ())] >= m[("kvtier:kv_drift_kl", ())]
    assert 0.0 <= m[("kvtier:kv_drift_top1_agreement", ())] <= 1.0
    assert m[("kvtier:kv_drift_request_kl_count", ())] == 2
    assert m[("kvtier:kv_drift_request_kl_bucket", (("le", "+Inf"),))] == 2
    assert m[("kvtier:kv_drift_shadow_seconds_total", ())] > 0.0
    server.check_idle_clean()
    assert "Traceback" not in server.log(), server.log()


def test_no_drift_series_when_the_monitor_is_off(server_model_dir):
    llm = LLM(str(server_model_dir), dtype="float32", num_device_blocks=32, block_size=4)
    metrics = ServerMetrics(llm.engine.admin.stats)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
    assert llm.engine.drift is None
    assert drift_series(parse(metrics.render())) == {}
