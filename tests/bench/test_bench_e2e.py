"""`kvtier bench` end to end: real HTTP against a real kvtier server on a tiny model.

Behaviour only, never timings: what the records, the summary, the metric deltas and the files
say about the cache.
"""

from __future__ import annotations

import json

from conftest import SERVE_FLAGS

SMALL_SHARED = (
    "--workload",
    "shared_prefix",
    "--num-groups",
    "2",
    "--prompts-per-group",
    "3",
    "--system-tokens",
    "48",
    "--question-tokens",
    "6",
    "--output-tokens",
    "4",
)


def _records(result: dict, run: str) -> list[dict]:
    return result["runs"][run]["records"]


def test_bench_model_mode_writes_json_markdown_png_and_warm_requests_hit(bench, bench_model_dir):
    rc, result, out = bench("--model", str(bench_model_dir), *SERVE_FLAGS, *SMALL_SHARED, "--concurrency", "1")
    assert rc == 0
    assert (out / "shared_prefix_run.md").read_text().startswith("# kvtier bench: shared_prefix (run)")
    assert (out / "shared_prefix_run_ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    recs = _records(result, "shared_prefix")
    assert len(recs) == 6 and all(r["error"] is None for r in recs)
    for r in recs:
        assert r["prompt_tokens"] == 54 and r["completion_tokens"] == 4
        assert r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"]
        assert len(r["itl_s"]) == 3  # one gap per token after the first (kvtier streams each step)
        assert r["cached_tokens_by_tier"] is not None
    cold = [r for r in recs if not r["warm"]]
    warm = [r for r in recs if r["warm"]]
    assert len(cold) == 2 and len(warm) == 4  # first sight of each group's system prompt
    # one at a time: every warm request finds its group's whole system prompt (48 tokens)
    assert all(r["cached_tokens"] >= 48 for r in warm)
    assert all(r["cached_tokens"] < 48 for r in cold)
    s = result["runs"]["shared_prefix"]["summary"]
    assert s["requests"] == 6 and s["errors"] == 0 and s["output_tokens"] == 24
    assert s["warm"]["requests"] == 4 and s["ttft_s"]["p95"] is not None
    assert s["cache"]["cached_tokens"] == sum(r["cached_tokens"] for r in recs)
    m = result["runs"]["shared_prefix"]["metrics"]
    assert m["server"] == "kvtier"
    assert m["prefix_hits_by_tier"]["device"] == s["cache"]["cached_tokens"]
    assert m["recomputed_tokens"] == 6 * 54 - s["cache"]["cached_tokens"]


def test_bench_isolation_scenario_passes(bench, bench_model_dir):
    rc, result, out = bench(
        "--model",
        str(bench_model_dir),
        *SERVE_FLAGS,
        "--scenario",
        "isolation",
        "--num-requests",
        "3",
        "--prompt-tokens",
        "24",
        "--output-tokens",
        "2",
    )
    assert rc == 0
    iso = result["isolation"]
    assert iso["passed"] is True, iso
    assert iso["tenant_b_cached_tokens"] == 0 and iso["tenant_a_repeat_cached_tokens"] > 0
    assert all(r["cached_tokens"] == 0 for r in _records(result, "tenant_b"))
    assert all(r["cached_tokens"] > 0 and r["warm"] for r in _records(result, "tenant_a_repeat"))
    assert not any(r["warm"] for r in _records(result, "tenant_b"))
    assert "Isolation check: PASS" in (out / "independent_isolation.md").read_text()


def test_bench_url_mode_trace_replay_against_a_separate_server(bench, url_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 200, "input_length": 1500, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 400, "input_length": 900, "output_length": 3, "hash_ids": [10, 11]},
        {"timestamp": 600, "input_length": 1024, "output_length": 3, "hash_ids": [7, 8]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, result, _out = bench(
        "--url",
        url_server.url,
        "--workload",
        "trace",
        "--trace",
        str(trace),
        "--block-tokens",
        "16",
        "--speedup",
        "4",
        "--output-tokens",
        "2",
        "--concurrency",
        "1",
    )
    assert rc == 0
    recs = _records(result, "trace")
    assert [r["prompt_tokens"] for r in recs] == [32, 47, 29, 32]
    assert [r["warm"] for r in recs] == [False, True, False, True]
    # the second record extends the first (ids 7, 8): its first 32 tokens come from the cache;
    # the fourth repeats the first
    assert recs[1]["cached_tokens"] >= 28 and recs[3]["cached_tokens"] >= 28
    assert recs[0]["cached_tokens"] == 0
    m = result["runs"]["trace"]["metrics"]
    assert m["prefix_hits_by_tier"]["device"] >= recs[1]["cached_tokens"] + recs[3]["cached_tokens"]
    assert "host" in m["bytes_written_by_tier"]  # the server's host tier took the blocks
    assert result["target"] == url_server.url


def test_bench_url_mode_concurrency_sweep_and_text_prompts(bench, url_server):
    rc, result, out = bench(
        "--url",
        url_server.url,
        "--workload",
        "multi_turn",
        "--scenario",
        "concurrency",
        "--concurrency-sweep",
        "1,2",
        "--num-sessions",
        "2",
        "--turns",
        "2",
        "--system-tokens",
        "24",
        "--user-tokens",
        "8",
        "--reply-tokens",
        "4",
        "--think-time-s",
        "0",
        "--output-tokens",
        "2",
        "--text-prompts",
    )
    assert rc == 0
    assert [p["concurrency"] for p in result["sweep"]] == [1, 2]
    assert all(p["errors"] == 0 for p in result["sweep"])
    assert (out / "multi_turn_concurrency_concurrency.png").exists()
    for run in ("c1", "c2"):
        recs = _records(result, run)
        assert len(recs) == 4 and all(r["prompt_tokens"] and r["prompt_tokens"] > 0 for r in recs)
        # each point runs under its own cache salt: its first turns miss (but for the BOS token
        # every text prompt starts with), its second turns reuse the first turn's prompt
        assert all(r["cached_tokens"] <= 1 for r in recs if r["turn"] == 0)
        assert any(r["cached_tokens"] > 0 for r in recs if r["turn"] == 1)


def test_bench_reports_usage_errors(bench, url_server, bench_model_dir, capsys):
    rc, _, _ = bench("--url", url_server.url, "--scenario", "isolation")
    assert rc == 2 and "--tenant-keys" in capsys.readouterr().err
    rc, _, _ = bench("--url", url_server.url, "--scenario", "host_full")
    assert rc == 2 and "--model" in capsys.readouterr().err
    rc, _, _ = bench("--url", url_server.url, "--host-cache-bytes", "1MiB")
    assert rc == 2 and "with --url" in capsys.readouterr().err
    rc, _, _ = bench("--model", str(bench_model_dir), "--workload", "trace")
    assert rc == 2 and "--trace" in capsys.readouterr().err


def test_bench_url_mode_mixed_scenario_reports_each_kind(bench, url_server):
    rc, result, _ = bench(
        "--url",
        url_server.url,
        "--scenario",
        "mixed",
        "--num-sessions",
        "2",
        "--turns",
        "2",
        "--system-tokens",
        "24",
        "--user-tokens",
        "8",
        "--reply-tokens",
        "4",
        "--think-time-s",
        "0",
        "--num-requests",
        "3",
        "--prompt-tokens",
        "12",
        "--output-tokens",
        "2",
    )
    assert rc == 0 and result["workload"] == "mixed"
    by_tag = result["runs"]["mixed"]["summary"]["by_tag"]
    assert by_tag["long"]["requests"] == 4 and by_tag["short"]["requests"] == 3
    recs = _records(result, "mixed")
    assert all(r["cached_tokens"] == 0 and not r["warm"] for r in recs if r["tag"] == "short")
    assert any(r["cached_tokens"] > 0 for r in recs if r["tag"] == "long")


def test_bench_slow_storage_scenario_restarts_the_server_with_tier_faults(bench, bench_model_dir):
    rc, result, _out = bench(
        "--model",
        str(bench_model_dir),
        "--dtype",
        "float32",
        "--block-size",
        "4",
        "--num-device-blocks",
        "64",
        "--scenario",
        "slow_storage",
        "--tier-faults",
        "host=latency_ms=1",
        "--workload",
        "multi_turn",
        "--num-sessions",
        "2",
        "--turns",
        "2",
        "--system-tokens",
        "24",
        "--user-tokens",
        "8",
        "--reply-tokens",
        "4",
        "--think-time-s",
        "0",
        "--output-tokens",
        "2",
    )
    assert rc == 0
    assert result["tier_faults"] == {"host": "latency_ms=1"}
    base, slowed = result["runs"]["baseline"], result["runs"]["slowed"]
    assert "--tier-faults" not in base["server_flags"] and "--host-cache-bytes" in base["server_flags"]
    i = slowed["server_flags"].index("--tier-faults")
    assert slowed["server_flags"][i + 1] == "host=latency_ms=1"
    for run in (base, slowed):
        assert run["summary"]["errors"] == 0
        assert run["metrics"]["bytes_written_by_tier"]["host"] > 0  # write-through to the host tier
