"""The traffic profiler finds what a prefix cache can and cannot reuse."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sim.profile import analyze, parse_records, summary

REPO = Path(__file__).resolve().parents[2]


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def lines(objs) -> list[str]:
    return [json.dumps(o) for o in objs]


def test_shared_system_prompt_at_the_front_is_reused():
    system = toks(0, 320)
    reqs = [{"prompt_token_ids": system + toks(10 + i, 50), "arrival_time": 100.0 + i} for i in range(10)]
    s = summary(analyze(parse_records(lines(reqs))))
    assert s["requests"] == 10 and s["requests_with_reuse"] == 9
    assert s["reusable_prefix_tokens"]["p50"] == 320  # 20 blocks of 16
    assert s["reuse_interval_s"]["p50"] == 1.0
    assert s["ideal_hit_rate"] == pytest.approx(9 * 320 / (10 * 370), abs=1e-4)
    assert s["shared_segment"]["not_at_start_and_missed_by_prefix_cache"] == 0


def test_shared_segment_behind_a_unique_header_is_found_and_reported():
    shared = toks(1, 400)
    reqs = [{"prompt_token_ids": toks(20 + i, 40) + shared + toks(40 + i, 30)} for i in range(10)]
    s = summary(analyze(parse_records(lines(reqs))))
    assert s["ideal_hit_rate"] == 0.0  # a prefix cache reuses nothing here
    assert s["shared_segment"]["not_at_start_and_missed_by_prefix_cache"] == 9
    assert s["shared_segment"]["start_p50"] == 40
    assert any("starts at token 40" in r and "move it to the front" in r for r in s["recommendations"])


def test_multi_turn_conversations_are_counted():
    turn1 = toks(2, 64)
    turn2 = turn1 + toks(3, 64)
    turn3 = turn2 + toks(4, 64)
    other = toks(5, 64)
    s = summary(analyze(parse_records(lines([turn1, other, turn2, turn3]))))
    assert s["multi_turn_ratio"] == 0.5
    assert s["reusable_prefix_tokens"]["max"] == 128


def test_mooncake_records_use_512_token_blocks_and_ms_timestamps():
    recs = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
    ]
    s = summary(analyze(parse_records(lines(recs))))
    assert s["block_tokens"] == 512
    assert s["reusable_prefix_tokens"]["p50"] == 1024 and s["reuse_interval_s"]["p50"] == 2.0
    assert s["ideal_hit_rate"] == pytest.approx(1024 / 3200, abs=1e-4)


def test_real_trace_profile(tmp_path):
    trace = Path("/work/shared/data/traces/conversation_trace.jsonl")
    if not trace.exists():
        trace = REPO.parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"
    if not trace.exists():
        pytest.skip("the shared traces are not beside this checkout")
    head = trace.read_text().splitlines()[:2000]
    s = summary(analyze(parse_records(head)))
    assert s["requests"] == 2000 and 0.0 < s["ideal_hit_rate"] < 1.0


def test_bad_lines_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        list(parse_records(["[1, 2]", "{oops"]))
    with pytest.raises(ValueError, match="needs --tokenizer"):
        list(parse_records(['{"prompt": "hello"}']))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    p = subprocess.run(
        [sys.executable, "-m", "kvtier", "analyze", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert p.returncode == 2 and "line 1" in p.stderr and "Traceback" not in p.stderr


def test_cli_json(tmp_path):
    log = tmp_path / "log.jsonl"
    system = toks(0, 160)
    log.write_text("\n".join(lines([{"prompt_token_ids": system + toks(i, 20)} for i in range(5)])) + "\n")
    p = subprocess.run(
        [sys.executable, "-m", "kvtier", "analyze", str(log), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["requests"] == 5 and s["requests_with_reuse"] == 4
