"""Scenarios: which runs to make, against which server, and what each one reports.

    run           the workload once
    concurrency   the workload at each of --concurrency-sweep sessions in flight
    host_full     with a roomy host tier, then with a small one (--host-full-bytes)
    slow_storage  without, then with the tier faults of --tier-faults (default: a slow host tier)
    mixed         long shared-prefix sessions + short independent prompts, reported per kind
    isolation     tenant A sends prompts twice, tenant B the same ones: B must get no cached token

Every run: /metrics before, the sessions through `client.run_sessions`, /metrics after. Runs on
one server are kept apart by a `cache_salt` per run (unless --no-cache-salt), so a later run
does not find an earlier run's KV.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.bench import metrics as M
from kvtier.bench import server as S
from kvtier.bench.client import ClientConfig, PrefixTracker, RequestRecord, run_sessions
from kvtier.bench.report import machine, markdown, plots, summarize
from kvtier.bench.workloads import Session, WorkloadConfig, build

SCENARIOS = ("run", "concurrency", "host_full", "slow_storage", "mixed", "isolation")
"""What `BenchConfig.scenario` may name (see above)."""
PRESSURE_DEVICE_BLOCKS = 64
"""Device pool of the pressure scenarios when the command sets none (so the tiers get used)."""
DEFAULT_SLOW_FAULTS = {"host": "latency_ms=50,bandwidth_mbps=100"}
ROOMY_HOST_BYTES = 1 << 30
TENANT_KEYS = {"kvtier-bench-tenant-a": "bench-a", "kvtier-bench-tenant-b": "bench-b"}


@dataclass
class BenchConfig:
    workload: str = "shared_prefix"
    workload_config: WorkloadConfig = field(default_factory=WorkloadConfig)
    scenario: str = "run"
    url: str | None = None
    model: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """LLM keyword arguments for the server the harness starts (--model)."""
    served_model_name: str | None = None
    api_key: str | None = None
    tenant_keys: tuple[str, str] | None = None
    """Two API keys of different tenants (isolation against --url)."""
    concurrency: int | None = None
    concurrency_sweep: tuple[int, ...] = (1, 2, 4, 8)
    text_prompts: bool = False
    logprobs: bool = False
    return_token_ids: bool = True
    salt_runs: bool = True
    host_full_bytes: int = 8 << 20
    timeout_s: float = 600.0
    progress: bool = True
    out_dir: Path = Path("bench-out")
    name: str | None = None
    command: str = ""


class Targets:
    """Server URLs: the --url one, or a `kvtier serve` for the flags asked for (one at a time,
    as servers would share the cores: asking for other flags stops the running one)."""

    def __init__(self, cfg: BenchConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self._server: S.ManagedServer | None = None

    def url(self, engine_kwargs: dict[str, Any] | None = None, api_keys: dict[str, str] | None = None) -> str:
        cfg = self.cfg
        if cfg.url is not None:
            if engine_kwargs is not None:
                raise ValueError(
                    f"the {cfg.scenario} scenario restarts the server with other tier "
                    "settings; run it with --model (the harness starts kvtier serve)"
                )
            return cfg.url.rstrip("/")
        flags = S.serve_flags(cfg.engine_kwargs if engine_kwargs is None else engine_kwargs)
        if api_keys:
            flags += ["--api-keys", str(S.write_api_keys(self.log_dir / "api_keys.json", api_keys))]
        if self._server is None or self._server.flags != flags:
            self.close()
            assert cfg.model is not None
            log = self.log_dir / f"serve-{uuid.uuid4().hex[:8]}.log"
            self._server = S.start(cfg.model, flags, log)
        return self._server.url

    def flags_of(self, url: str) -> list[str] | None:
        """The `kvtier serve` flags of the server at `url` (None: not one the harness started)."""
        return self._server.flags if self._server is not None and self._server.url == url else None

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _client(cfg: BenchConfig, url: str, **overrides: Any) -> ClientConfig:
    base = ClientConfig(
        url=url,
        model=cfg.served_model_name,
        api_key=cfg.api_key,
        concurrency=cfg.concurrency,
        text_prompts=cfg.text_prompts,
        logprobs=cfg.logprobs,
        return_token_ids=cfg.return_token_ids,
        timeout_s=cfg.timeout_s,
        progress=cfg.progress,
    )
    if cfg.workload == "trace":  # track prefixes at the trace's block granularity
        base = replace(base, prefix_granule=min(base.prefix_granule, cfg.workload_config.block_tokens))
    return replace(base, **overrides)


def _salt(cfg: BenchConfig, run_id: str, name: str) -> str | None:
    return f"kvtier-bench-{run_id}-{name}" if cfg.salt_runs else None


def one_run(
    name: str,
    client: ClientConfig,
    sessions: Sequence[Session],
    flags: list[str] | None,
    tracker: PrefixTracker | None = None,
) -> tuple[dict[str, Any], list[RequestRecord]]:
    before = M.scrape(client.url)
    records, wall_s = asyncio.run(run_sessions(client, sessions, desc=name, tracker=tracker))
    after = M.scrape(client.url)
    deltas = M.counter_deltas(before, after)
    run = {
        "summary": summarize(records, wall_s),
        "metrics": M.headline(deltas),
        "metric_deltas": M.deltas_json(deltas),
        "server_flags": flags,
        "client": {
            "concurrency": client.concurrency,
            "cache_salt": client.cache_salt,
            "text_prompts": client.text_prompts,
        },
        "records": [r.to_json() for r in records],
    }
    return run, records


def _default_concurrency(cfg: BenchConfig) -> int | None:
    if cfg.concurrency is not None:
        return cfg.concurrency
    timed = cfg.workload == "trace" or cfg.workload_config.rate is not None
    return None if timed else 4


def _pressure_kwargs(cfg: BenchConfig) -> dict[str, Any]:
    kw = dict(cfg.engine_kwargs)
    if "num_device_blocks" not in kw and "kv_cache_bytes" not in kw:
        kw["num_device_blocks"] = PRESSURE_DEVICE_BLOCKS
    return kw


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Run the scenario; writes JSON, Markdown and PNGs under cfg.out_dir; returns the result."""
    if cfg.scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {cfg.scenario!r}; choose from {', '.join(SCENARIOS)}")
    if (cfg.url is None) == (cfg.model is None):
        raise ValueError("give exactly one target: --model DIR (kvtier serve, started here) or --url URL")
    if cfg.url is not None and cfg.engine_kwargs:
        raise ValueError(
            "engine and tier flags configure the server the harness starts; with --url "
            "configure that server instead (or use --model)"
        )
    if cfg.scenario in ("mixed", "isolation"):
        cfg = replace(cfg, workload="mixed" if cfg.scenario == "mixed" else "independent")
    cfg = replace(cfg, concurrency=_default_concurrency(cfg))
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = cfg.name or f"{cfg.workload}_{cfg.scenario}"
    targets = Targets(cfg, out_dir / f"{stem}_logs")
    result: dict[str, Any] = {
        "workload": cfg.workload,
        "scenario": cfg.scenario,
        "target": cfg.url or f"kvtier serve --model {cfg.model} (started by the harness)",
        "command": cfg.command,
        "machine": machine(),
        "workload_config": {k: v for k, v in vars(cfg.workload_config).items()},
        "runs": {},
    }
    records_by_run: dict[str, list[RequestRecord]] = {}
    try:
        SCENARIO_FUNCS[cfg.scenario](cfg, targets, result, records_by_run)
    finally:
        targets.close()
    result["plots"] = plots(result, records_by_run, out_dir, stem)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    import json

    json_path.write_text(json.dumps(result, indent=1, default=str))
    md_path.write_text(markdown(result))
    result["files"] = {"json": str(json_path), "markdown": str(md_path), "plots": result["plots"]}
    return result


# ------------------------------------------------------------------ scenarios
Scenario = Callable[[BenchConfig, Targets, dict, dict], None]


def _record(result: dict, records_by_run: dict, name: str, run: dict, records: list[RequestRecord]) -> None:
    result["runs"][name] = run
    records_by_run[name] = records


def scenario_run(cfg: BenchConfig, targets: Targets, result: dict, records_by_run: dict) -> None:
    run_id = uuid.uuid4().hex[:8]
    url = targets.url()
    sessions = build(cfg.workload, cfg.workload_config)
    client = _client(cfg, url, cache_salt=_salt(cfg, run_id, cfg.workload))
    run, records = one_run(cfg.workload, client, sessions, targets.flags_of(url))
    _record(result, records_by_run, cfg.workload, run, records)


def scenario_concurrency(cfg: BenchConfig, targets: Targets, result: dict, records_by_run: dict) -> None:
    run_id = uuid.uuid4().hex[:8]
    url = targets.url()
    sweep = []
    for c in cfg.concurrency_sweep:
        name = f"c{c}"
        client = _client(cfg, url, concurrency=c, cache_salt=_salt(cfg, run_id, name))
        run, records = one_run(name, client, build(cfg.workload, cfg.workload_config), targets.flags_of(url))
        _record(result, records_by_run, name, run, records)
        s = run["summary"]
        sweep.append(
            {
                "concurrency": c,
                "requests_per_s": s["requests_per_s"],
                "output_tokens_per_s": s["output_tokens_per_s"],
                "ttft_p50_s": s["ttft_s"]["p50"],
                "ttft_p95_s": s["ttft_s"]["p95"],
                "itl_p95_s": s["itl_s"]["p95"],
                "cached_fraction": s["cache"]["cached_fraction"],
                "errors": s["errors"],
            }
        )
    result["sweep"] = sweep


def _two_configs(
    cfg: BenchConfig, targets: Targets, result: dict, records_by_run: dict, configs: list[tuple[str, dict[str, Any]]]
) -> None:
    run_id = uuid.uuid4().hex[:8]
    for name, kw in configs:
        url = targets.url(kw)
        client = _client(cfg, url, cache_salt=_salt(cfg, run_id, name))
        run, records = one_run(name, client, build(cfg.workload, cfg.workload_config), targets.flags_of(url))
        _record(result, records_by_run, name, run, records)


def scenario_host_full(cfg: BenchConfig, targets: Targets, result: dict, records_by_run: dict) -> None:
    base = _pressure_kwargs(cfg)
    roomy = {**base, "host_cache_bytes": max(base.get("host_cache_bytes") or 0, ROOMY_HOST_BYTES)}
    full = {**base, "host_cache_bytes": cfg.host_full_bytes}
    _two_configs(cfg, targets, result, records_by_run, [("host_roomy", roomy), ("host_full", full)])


def scenario_slow_storage(cfg: BenchConfig, targets: Targets, result: dict, records_by_run: dict) -> None:
    base = _pressure_kwargs(cfg)
    faults = base.pop("tier_faults", None) or DEFAULT_SLOW_FAULTS
    if not any(k in base for k in ("host_cache_bytes", "disk_cache_dir", "remote_cache_url")):
        base["host_cache_bytes"] = ROOMY_HOST_BYTES
    result["tier_faults"] = faults
    _two_configs(
        cfg, targets, result, records_by_run, [("baseline", base), ("slowed", {**base, "tier_faults": faults})]
    )


def scenario_isolation(cfg: BenchConfig, targets: Targets, result: dict, records_by_run: dict) -> None:
    """Tenant A sends distinct prompts, then again (its cache must hit), then tenant B sends the
    same prompts: every one of B's requests must report 0 cached tokens."""
    if cfg.url is not None:
        if cfg.tenant_keys is None:
            raise ValueError(
                "the isolation scenario against --url needs --tenant-keys KEY_A,KEY_B "
                "(API keys of two different tenants)"
            )
        key_a, key_b = cfg.tenant_keys
        url = targets.url()
    else:
        key_a, key_b = TENANT_KEYS
        url = targets.url(cfg.engine_kwargs, api_keys=TENANT_KEYS)
    salt = _salt(cfg, uuid.uuid4().hex[:8], "isolation")  # one salt: only the tenant differs
    wc = replace(cfg.workload_config, rate=None)
    sessions = build("independent", wc)
    phases = [("tenant_a_first", key_a), ("tenant_a_repeat", key_a), ("tenant_b", key_b)]
    tracker = PrefixTracker()  # across the phases: A's repeat is warm, B's first sight cold
    for name, key in phases:
        client = _client(cfg, url, api_key=key, cache_salt=salt)
        run, records = one_run(name, client, sessions, targets.flags_of(url), tracker)
        _record(result, records_by_run, name, run, records)
    a_repeat, b = records_by_run["tenant_a_repeat"], records_by_run["tenant_b"]
    errors = sum(r.error is not None for rs in records_by_run.values() for r in rs)
    a_cached = sum(r.cached_tokens or 0 for r in a_repeat)
    b_cached = sum(r.cached_tokens or 0 for r in b)
    reported = all(r.cached_tokens is not None for r in a_repeat + b)
    leaks = [r.request_index for r in b if r.cached_tokens]
    passed = errors == 0 and reported and a_cached > 0 and b_cached == 0
    if errors:
        detail = f"{errors} requests failed: {[r.error for rs in records_by_run.values() for r in rs if r.error][:2]}"
    elif not reported:
        detail = "the server did not report usage.prompt_tokens_details.cached_tokens"
    elif a_cached == 0:
        detail = "inconclusive: tenant A's repeat got no cached tokens (is prefix caching on?)"
    elif b_cached:
        detail = f"tenant B got {b_cached} cached tokens on {len(leaks)} of {len(b)} requests (KV crossed tenants)"
    else:
        detail = (
            f"tenant A's repeat reused {a_cached} cached tokens; tenant B, same {len(b)} prompts, got 0 cached tokens"
        )
    result["isolation"] = {
        "passed": passed,
        "detail": detail,
        "tenant_a_repeat_cached_tokens": a_cached,
        "tenant_b_cached_tokens": b_cached,
        "tenant_b_requests_with_cached": len(leaks),
        "requests_per_phase": len(b),
    }


SCENARIO_FUNCS: dict[str, Scenario] = {
    "run": scenario_run,
    "concurrency": scenario_concurrency,
    "host_full": scenario_host_full,
    "slow_storage": scenario_slow_storage,
    "mixed": scenario_run,
    "isolation": scenario_isolation,
}
