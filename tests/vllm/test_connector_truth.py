"""What the vLLM connector plans is what happens (issue 36, items 1-4), in real vLLM-CPU.

    purge     `kvtier cache purge` of a tenant while vLLM runs (idle): its next request plans
              no restore (the scheduler polls the purge requests itself and drops the tenant's
              keys from its host mirror), the worker's disk index drops the deleted files, so
              the recomputed blocks are written to disk again
    corrupt   every disk file of a chain damaged: the first revisit's load fails at the first
              block, the worker drops the rest of the chain, vLLM recomputes and the whole chain
              is stored again; the next revisits are full restores that do not fail
    metrics   hit_tokens counts tokens that arrived, planned_hit_tokens what was planned; the
              tiers' usage (gauges), bytes written, corrupt blocks and purges are on /metrics

Each scenario is one vLLM process (vllm_runner.py) on the tiny 2-layer model; revisits reset
vLLM's own prefix cache first, so every cached token came from kvtier's tiers.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllmutil import REPO, RUNNER, VLLM_PY, _build_model, _run, _spec, _tokens, requires_vllm

pytestmark = requires_vllm

RNG = random.Random(36)
A = _tokens(RNG, 600) + _tokens(RNG, 10)  # 4 full 128-token blocks
C = _tokens(RNG, 600) + _tokens(RNG, 10)
FULL = 512
"""Tokens of A's and C's 4 full blocks: a full restore."""


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.kv"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("vllm_truth")
    model = _build_model(tmp / "tiny")
    out: dict[str, dict] = {}

    disk = tmp / "disk_purge"
    revisit = {"reset_prefix_cache": True}
    purge = {"salt": "tenant-p", "disk_cache_dir": str(disk), "wait_s": 1.0}
    phases = [
        {"prompts": [C], "salts": ["tenant-p"], "metrics": True},
        {
            "prompts": [C],
            "salts": ["tenant-p"],
            "before": {"wait_files": {"dir": str(disk), "count": 4, "timeout_s": 60}, **revisit},
            "metrics": True,
        },
        {"prompts": [C], "salts": ["tenant-p"], "before": {"purge": purge, **revisit}, "metrics": True},
        {
            "prompts": [C],
            "salts": ["tenant-p"],
            "before": {"count_files": {"dir": str(disk), "count": 4, "timeout_s": 60}, **revisit},
            "metrics": True,
        },
    ]
    connector = {
        "host_cache_bytes": "64MiB",
        "disk_cache_dir": str(disk),
        "purge_check_interval_s": 0.1,
        "restore_policy": "always",  # the tiny model recomputes in no time: restore anyway
    }
    out["purge"] = _run(tmp, "purge", _spec(model, phases, connector))
    out["purge"]["disk_files"] = _files(disk / next(d.name for d in disk.iterdir() if len(d.name) == 32))

    disk = tmp / "disk_corrupt"
    phases = [
        {"prompts": [A], "metrics": True},
        {
            "prompts": [A],
            "before": {
                "wait_files": {"dir": str(disk), "count": 4, "timeout_s": 60},
                "corrupt_dir": str(disk),
                **revisit,
            },
            "metrics": True,
        },
        {
            "prompts": [A],
            "before": {"count_files": {"dir": str(disk), "count": 4, "timeout_s": 60}, **revisit},
            "metrics": True,
        },
        {"prompts": [A], "before": revisit, "metrics": True},
    ]
    out["corrupt"] = _run(
        tmp, "corrupt", _spec(model, phases, {"disk_cache_dir": str(disk), "restore_policy": "always"})
    )
    return out


def _m(phase: dict, name: str) -> float:
    return phase["metrics"].get(f"vllm:kvtier_{name}", 0) or 0


def test_scenarios_import_this_checkouts_kvtier(runs):
    assert f"kvtier imported from {REPO / 'kvtier'}\n" in runs["purge"]["log"]


def test_purge_then_request_plans_no_restore(runs):
    p = runs["purge"]["phases"]
    assert p[1]["cached"] == [FULL], "before the purge the tenant's prefix comes back from kvtier's host tier"
    assert p[2]["cached"] == [0]
    # nothing was planned for the purged tenant: no restore planned, no load that failed
    for name in ("planned_hit_tokens", "decisions_restore", "loads", "load_failures", "failed_hit_tokens"):
        assert _m(p[2], name) == _m(p[1], name), (name, p[1]["metrics"], p[2]["metrics"])
    assert _m(p[1], "load_failures") == 0 and _m(p[3], "load_failures") == 0
    assert _m(p[3], "load_blocks") == _m(p[3], "host_hit_blocks") == 8, p[3]["metrics"]
    assert p[0]["outputs"] == p[1]["outputs"] == p[2]["outputs"] == p[3]["outputs"]
    assert "purged tenant" in runs["purge"]["log"]


def test_cli_purge_leaves_the_workers_disk_index_true(runs):
    """The purge deleted the tenant's 4 files; the running worker's disk index drops them, so
    the recomputed blocks are written again (files on disk) and the index counts what is there."""
    run = runs["purge"]
    p = run["phases"]
    assert p[3]["files"] == 4, "the tenant's recomputed blocks were written to disk again"
    assert p[3]["cached"] == [FULL], "and they come back on the next revisit"
    metrics = run["metrics"]
    assert metrics["vllm:kvtier_disk_entries"] == 4, metrics
    on_disk = sum(f.stat().st_blocks * 512 for f in run["disk_files"])
    assert len(run["disk_files"]) == 4 and metrics["vllm:kvtier_disk_usage_bytes"] == on_disk, metrics
    assert "disk_index_dropped': 4" in run["log"]


def test_hit_tokens_count_tokens_that_arrived_and_tier_gauges(runs):
    run = runs["purge"]
    metrics = run["metrics"]
    # vLLM's prefix cache is reset before each revisit, and no load failed: what was cached arrived
    arrived = sum(sum(ph["cached"]) for ph in run["phases"])
    assert arrived == 2 * FULL and metrics["vllm:kvtier_load_failures"] == 0, metrics
    assert metrics["vllm:kvtier_hit_tokens"] == arrived, metrics
    assert metrics["vllm:kvtier_planned_hit_tokens"] == arrived, metrics
    assert metrics.get("vllm:kvtier_failed_hit_tokens", 0) == 0, metrics
    assert metrics["vllm:kvtier_host_entries"] == 4, metrics
    assert metrics["vllm:kvtier_host_usage_bytes"] > 0, metrics
    assert metrics["vllm:kvtier_disk_bytes_written"] > 0, metrics
    assert metrics["vllm:kvtier_purges"] >= 1, metrics


def test_corrupt_chain_is_repaired_in_one_visit(runs):
    p = runs["corrupt"]["phases"]
    assert p[1]["cached"] == [0], "every file is damaged: the first revisit recomputes"
    assert p[2]["files"] == 4, "the whole chain was stored again"
    assert p[2]["cached"] == [FULL], "the second revisit is a full restore"
    assert p[3]["cached"] == [FULL]
    assert p[0]["outputs"] == p[1]["outputs"] == p[2]["outputs"] == p[3]["outputs"]
    # vLLM's num_cached_tokens counts a connector's planned tokens even when some fail to load:
    # the workers' counts say what arrived. One failed load (the damaged visit) and no more:
    # the later revisits bring all 4 blocks each
    assert _m(p[1], "load_failures") == 1 and _m(p[3], "load_failures") == 1, p[3]["metrics"]
    assert _m(p[1], "load_blocks") == 0 and _m(p[2], "disk_hit_blocks") == 4, p[2]["metrics"]
    assert _m(p[3], "load_blocks") == _m(p[3], "disk_hit_blocks") == 8, p[3]["metrics"]
    assert _m(p[1], "corrupt_blocks") == 1, p[1]["metrics"]


def test_corrupt_metrics_count_arrivals_not_plans(runs):
    p = runs["corrupt"]["phases"]
    assert _m(p[1], "planned_hit_tokens") == FULL
    assert _m(p[1], "hit_tokens") == 0, "a load that failed brought nothing: no hit"
    assert _m(p[1], "failed_hit_tokens") == FULL
    assert _m(p[3], "planned_hit_tokens") == 3 * FULL
    assert _m(p[3], "hit_tokens") == 2 * FULL == sum(sum(ph["cached"]) for ph in p)
    assert _m(p[3], "failed_hit_tokens") == FULL


def test_gauges_host_mirror_and_worker_meta_without_an_engine():
    proc = subprocess.run(
        [VLLM_PY, str(RUNNER.with_name("connector_checks.py"))],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # each rank's latest value, summed over ranks: never summed over steps
    assert out["gauges"]["logged"] == {"hit_tokens": 128, "disk_usage_bytes": 170}
    assert out["gauges"]["prom"] == [150.0, 170.0]
    assert out["gauges"]["hits"] == 128.0 and out["gauges"]["empty"] is True
    # a purged tenant's keys leave the mirror at once; the other tenant's stay
    assert out["mirror"] == [[2, 2], 2, [0, 2], [0, 2, 2]]
    assert out["meta_purged"] == ["t1", "t2"]
