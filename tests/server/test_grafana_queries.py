"""vLLM's example Grafana dashboard and alert rules, stored unchanged under data/ (see
data/README.md for where they come from), against a live `kvtier serve`: every panel target's
and alert rule's PromQL, its Grafana variables filled in, selects series that exist (with the
dashboard's model_name filter), and every series a rate() or increase() reads moves while
requests are served. The queries are evaluated by what they select: each selector's matchers
against a scrape before and after, parsed by prometheus_client.

The names, labels and twins of the series are the server's (its metrics module): the default
process engine mode only (conftest.py). The engine's statistics reach /metrics through the
engine client, so the dashboard's queries get data in both modes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.utils import floatToGoString
from serverutil import ENGINE_MODES, MODEL_NAME, scrape
from test_metrics import check_vllm_families, vllm_buckets, vllm_sample_names

pytest.importorskip("openai")

pytestmark = pytest.mark.engine_modes("process")
DATA = Path(__file__).with_name("data")
GRAFANA_VARIABLES = {
    "$model_name": MODEL_NAME,
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "5m",
}
SELECTOR = re.compile(
    r"(?P<name>[A-Za-z_][\w]*:[\w:]*|[A-Za-z_]\w*(?=\s*\{))"  # a metric name (vLLM's have a colon)
    r"\s*(?:\{(?P<matchers>[^}]*)\})?"
    r"(?P<range>\s*\[[^\]]+\])?"
)
MATCHER = re.compile(r'\s*(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
MORE_SERIES = [
    "vllm:request_inference_time_seconds_count",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_count",
    "vllm:iteration_tokens_total_count",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:request_num_preemptions_count",
    "vllm:request_prefill_kv_computed_tokens_count",
    "vllm:prefix_cache_queries_total",
    "vllm:prompt_tokens_cached_total",
]
NOT_THE_SERVERS = {"up"}
"""Series Prometheus makes itself (the alert rules' replica count), not read from /metrics."""


def dashboard_queries() -> list[str]:
    """Every panel target's expr of vLLM's dashboard (rows' panels included)."""
    board = json.loads((DATA / "vllm_grafana.json").read_text())
    panels = list(board["panels"])
    for p in board["panels"]:
        panels += p.get("panels", [])
    return [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]


def alert_queries() -> list[str]:
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((DATA / "vllm_prometheusrule.yaml").read_text())
    return [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]


def fill(query: str) -> str:
    """The query with Grafana's variables as Grafana would send it to Prometheus."""
    for var, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        query = query.replace(var, value)
    assert "$" not in query, query
    return query


def selectors(query: str) -> list[tuple[str, list[tuple[str, str, str]], bool]]:
    """(metric name, label matchers, whether a range vector: what rate()/increase() read)."""
    out = []
    for m in SELECTOR.finditer(query):
        matchers = MATCHER.findall(m.group("matchers") or "")
        out.append((m.group("name"), matchers, m.group("range") is not None))
    return out


def select(samples: dict, name: str, matchers: list[tuple[str, str, str]]) -> list[float]:
    """The values of the samples a selector picks."""

    def ok(labels: dict[str, str]) -> bool:
        for label, op, value in matchers:
            have = labels.get(label, "")
            hit = re.fullmatch(value, have) is not None if op in ("=~", "!~") else have == value
            if hit != (op in ("=", "=~")):
                return False
        return True

    return [v for (n, labels), v in samples.items() if n == name and ok(dict(labels))]


def vllm_selects(name: str, matchers: list[tuple[str, str, str]]) -> bool:
    """Whether a selector picks series of vLLM 0.32's (by name, and for a bucket's `le`, by the
    bounds vLLM writes: "120.0", as prometheus_client formats them)."""
    if name not in vllm_sample_names():
        return False
    bounds = vllm_buckets(None).get(name.removesuffix("_bucket"))
    for label, op, value in matchers:
        if label == "le" and op == "=" and bounds is not None:
            return value in {*(floatToGoString(b) for b in bounds), "+Inf"}
    return True


def send_requests(server) -> None:
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


def test_the_stored_dashboard_and_rules_are_vllms():
    queries = dashboard_queries()
    assert len(queries) == 27 and all("vllm:" in q for q in queries)
    assert len(alert_queries()) == 8


@pytest.mark.engine_modes(*ENGINE_MODES)
def test_vllm_dashboard_and_alert_queries_get_data(server):
    before = scrape(server.url, model_name=True)
    send_requests(server)
    after = scrape(server.url, model_name=True)
    # the dashboard's model_name variable: label_values(model_name)
    assert {dict(labels).get("model_name") for n, labels in after if n.startswith("vllm:")} - {None} == {MODEL_NAME}
    checked = set()
    for query in [*dashboard_queries(), *alert_queries()]:
        found = selectors(fill(query))
        assert found, query
        for name, matchers, ranged in found:
            if name in NOT_THE_SERVERS:
                continue
            now = select(after, name, matchers)
            if not vllm_selects(name, matchers):
                # what vLLM 0.32 leaves empty too: VllmPreemptionSpike's rate(vllm:num_preemptions)
                # names the counter's family, whose series is vllm:num_preemptions_total; and
                # VllmSlowRequestsPresent's le="120" is no bucket of vLLM's, which writes le="120.0"
                assert not now, f"vLLM 0.32 has no {name}{matchers}, yet kvtier has ({query!r})"
                continue
            assert now, f"no {name}{matchers} for {query!r}"
            if ranged:
                was = select(before, name, matchers)
                assert sum(now) > sum(was), f"{name} did not move for {query!r}"
            checked.add(name)
    assert len(checked) == 21, checked
    for name in MORE_SERIES:  # the rest of vLLM's request-level set, which the dashboard does not chart
        assert sum(select(after, name, [])) > sum(select(before, name, [])), name


def test_vllm_series_over_http_are_vllm_0_32s(server):
    """The live server's vllm: families: vLLM 0.32's names, types, labels and buckets (those of
    token counts, which go up to max_model_len, are checked in process: test_metrics.py)."""
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200
    check_vllm_families(r.text)


def test_kvtier_and_vllm_twins_agree(server):
    """By default both sets are shown; a series under both prefixes has the same counts and sums
    (kvtier's buckets differ: finer below a second)."""
    send_requests(server)
    after = scrape(server.url, model_name=True)
    twins = 0
    for (n, labels), v in after.items():
        if not n.startswith("vllm:") or n.endswith(("_bucket", "_created")):
            continue
        own = tuple((k, x) for k, x in labels if k != "engine")
        twin = after.get(("kvtier:" + n.removeprefix("vllm:"), own))
        if twin is not None and n not in ("vllm:num_requests_waiting",):  # vLLM's counts the loading ones too
            assert twin == v, n
            twins += 1
    assert twins >= 40, twins
    info = [dict(labels) for (n, labels) in after if n == "kvtier:cache_config_info"]
    assert info and info[0]["block_size"] == "4"
    # the engine's tier series keep their own labels beside model_name
    queries = {dict(labels)["tier"] for (n, labels) in after if n == "kvtier:prefix_cache_queries_total"}
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
    usage = r.json()["usage"]
    for prefix in ("kvtier:", "vllm:"):

        def delta(name: str, prefix: str = prefix) -> float:
            return sum(select(after, prefix + name, [])) - sum(select(before, prefix + name, []))

        assert delta("request_params_n_sum") == 3
        assert delta("request_params_max_tokens_sum") == 7
        assert delta("request_generation_tokens_sum") == usage["completion_tokens"]
        assert delta("request_generation_tokens_count") == 3  # one per sample, as vLLM
        assert delta("generation_tokens_total") == usage["completion_tokens"]
        assert delta("prompt_tokens_total") == usage["prompt_tokens"]
        assert delta("request_success_total") == 3
