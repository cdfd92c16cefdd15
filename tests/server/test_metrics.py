"""The Prometheus collector in process: per-app registries, and tier series that follow what the
engine did (host tier hits and bytes, restore decisions, restore seconds by tier)."""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from kvtier import LLM, SamplingParams
from kvtier.engine.frontend import make_engine_client
from kvtier.server.app import ServerConfig, build_app
from kvtier.server.metrics import ServerMetrics

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def parse(text: bytes) -> dict:
    """{(sample name, sorted labels): value}; the model_name label every series carries is
    checked here and left out of the keys."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None), f"{s.name} has no model_name label"
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
