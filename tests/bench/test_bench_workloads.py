"""Workload shapes and determinism, trace synthesis, prefix tracking, percentiles, metric
deltas and the serve flags of the harness (no server)."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.bench import metrics as M
from kvtier.bench.client import PrefixTracker
from kvtier.bench.report import percentile
from kvtier.bench.server import serve_flags
from kvtier.bench.workloads import (
    WORKLOADS,
    WorkloadConfig,
    build,
    render_text,
    scaled_input_length,
    synth_tokens,
    trace,
)

SMALL = WorkloadConfig(
    system_tokens=40,
    question_tokens=8,
    user_tokens=8,
    reply_tokens=4,
    tool_tokens=24,
    step_tokens=6,
    doc_tokens=12,
    instruction_tokens=10,
    prompt_tokens=20,
    num_requests=12,
)
RECORDS = [
    {"timestamp": 1000, "input_length": 1000, "output_length": 7, "hash_ids": [1, 2]},
    {"timestamp": 3000, "input_length": 1300, "output_length": 9, "hash_ids": [1, 2, 3]},
    {"timestamp": 5000, "input_length": 600, "output_length": 3, "hash_ids": [1, 4]},
    {"timestamp": 9000, "input_length": 2000, "output_length": 3, "hash_ids": [5, 6]},
]


def _shape(sessions):
    return [
        (s.session_id, s.arrival_s, [(r.prompt, r.max_tokens, r.prefix_key, r.think_s) for r in s.requests])
        for s in sessions
    ]


@pytest.mark.parametrize("name", sorted(set(WORKLOADS) - {"trace"}))
def test_workloads_are_deterministic_by_seed(name):
    cfg = dataclasses.replace(SMALL, rate=5.0)
    assert _shape(build(name, cfg)) == _shape(build(name, cfg))
    assert _shape(build(name, cfg)) != _shape(build(name, dataclasses.replace(cfg, seed=1)))
    for s in build(name, cfg):
        for r in s.requests:
            assert all(100 <= t < cfg.vocab_size for t in r.prompt)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    sessions = build("shared_prefix", SMALL)
    assert len(sessions) == SMALL.num_groups * SMALL.prompts_per_group
    assert all(s.arrival_s == 0 and len(s.requests) == 1 for s in sessions)
    by_group: dict[str, list[list[int]]] = {}
    for s in sessions:
        r = s.requests[0]
        assert len(r.prompt) == SMALL.system_tokens + SMALL.question_tokens
        by_group.setdefault(r.prefix_key, []).append(r.prompt)
    assert len(by_group) == SMALL.num_groups
    systems = set()
    for prompts in by_group.values():
        assert len({tuple(p[: SMALL.system_tokens]) for p in prompts}) == 1
        assert len({tuple(p[SMALL.system_tokens :]) for p in prompts}) == len(prompts)
        systems.add(tuple(prompts[0][: SMALL.system_tokens]))
    assert len(systems) == SMALL.num_groups


def test_multi_turn_context_grows_with_think_time():
    sessions = build("multi_turn", SMALL)
    assert len(sessions) == SMALL.num_sessions
    for s in sessions:
        assert len(s.requests) == SMALL.turns
        assert s.requests[0].think_s == 0 and all(r.think_s > 0 for r in s.requests[1:])
        for prev, cur in zip(s.requests, s.requests[1:]):
            assert cur.prompt[: len(prev.prompt)] == prev.prompt
            assert len(cur.prompt) == len(prev.prompt) + SMALL.reply_tokens + SMALL.user_tokens
    assert len({tuple(s.requests[0].prompt) for s in sessions}) == len(sessions)


def test_agent_branches_share_tools_and_first_steps_then_diverge():
    cfg = dataclasses.replace(SMALL, branches=3, shared_steps=1, turns=3)
    sessions = build("agent", cfg)
    assert len(sessions) == cfg.num_sessions * cfg.branches
    tools = sessions[0].requests[0].prompt[: cfg.tool_tokens]
    assert all(s.requests[0].prompt[: cfg.tool_tokens] == tools for s in sessions)
    flow0 = [s for s in sessions if s.meta["flow"] == 0]
    # step 1's prompt (tools + task + shared step 0) is equal across branches; step 2's differs
    assert len({tuple(s.requests[1].prompt) for s in flow0}) == 1
    assert len({tuple(s.requests[2].prompt) for s in flow0}) == cfg.branches


def test_rag_documents_repeat_across_requests():
    cfg = dataclasses.replace(SMALL, num_requests=20, doc_pool=5, docs_per_request=2)
    sessions = build("rag", cfg)
    docs = [tuple(s.meta["docs"]) for s in sessions]
    assert all(len(set(d)) == 2 for d in docs)
    used = [d for pair in docs for d in pair]
    assert len(set(used)) < len(used)  # documents come back
    head = sessions[0].requests[0].prompt[: cfg.instruction_tokens]
    assert all(s.requests[0].prompt[: cfg.instruction_tokens] == head for s in sessions)


def test_independent_prompts_share_no_first_token_and_mixed_tags_both_kinds():
    sessions = build("independent", SMALL)
    assert len({s.requests[0].prompt[0] for s in sessions}) == SMALL.num_requests
    tags = {r.tag for s in build("mixed", SMALL) for r in s.requests}
    assert tags == {"long", "short"}


def test_poisson_arrivals_follow_rate():
    sessions = build("independent", dataclasses.replace(SMALL, num_requests=200, rate=10.0))
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    assert 10 < arrivals[-1] < 40  # 199 gaps of mean 0.1 s


def test_trace_equal_hash_ids_give_equal_tokens_and_lengths_are_honoured():
    cfg = WorkloadConfig(block_tokens=16, trace_block_tokens=512)
    sessions = trace(cfg, RECORDS)
    prompts = [s.requests[0].prompt for s in sessions]
    assert [len(p) for p in prompts] == [scaled_input_length(r["input_length"], 16, 512) for r in RECORDS]
    assert [len(p) for p in prompts] == [32, 41, 19, 63]
    # ids 1, 2 open records 0 and 1; id 1 opens record 2, whose second block (id 4) differs
    assert prompts[0] == prompts[1][:32]
    assert prompts[2][:16] == prompts[0][:16] and prompts[2][16:19] != prompts[0][16:19]
    assert prompts[1][32:] == synth_tokens(0, ("hash", 3), 16)[:9]  # last block truncated
    assert prompts[3][:32] == synth_tokens(0, ("hash", 5), 16) + synth_tokens(0, ("hash", 6), 16)
    assert len(prompts[3]) == 63 and prompts[3][32:] != prompts[0][:31]  # padded past its ids
    assert all(s.requests[0].prefix_key is None for s in sessions)


def test_trace_unscaled_blocks_and_arrival_speedup_and_limit():
    sessions = trace(WorkloadConfig(speedup=2.0), RECORDS)
    assert [s.arrival_s for s in sessions] == [0.0, 1.0, 2.0, 4.0]
    assert [len(s.requests[0].prompt) for s in sessions] == [1000, 1300, 600, 2000]
    assert trace(WorkloadConfig(limit=2), RECORDS)[1].arrival_s == 2.0
    assert len(trace(WorkloadConfig(limit=2), RECORDS)) == 2
    capped = trace(WorkloadConfig(output_tokens=8, trace_output=True), RECORDS)
    assert [s.requests[0].max_tokens for s in capped] == [7, 8, 3, 3]


def test_trace_file_and_errors(tmp_path):
    import json

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(RECORDS)))
    sessions = build("trace", WorkloadConfig(trace=str(path), block_tokens=16))
    assert [s.arrival_s for s in sessions] == [0.0, 2.0, 4.0, 8.0]  # sorted by timestamp
    with pytest.raises(ValueError, match="--trace"):
        build("trace", WorkloadConfig())
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="hash_ids"):
        build("trace", WorkloadConfig(trace=str(path)))


def test_render_text_keeps_prefixes():
    a, b = [101, 5000, 7], [101, 5000, 9]
    assert render_text(a).startswith(render_text(a[:2]))
    assert render_text(a)[: len(render_text(a[:2]))] == render_text(b)[: len(render_text(b[:2]))]
    assert render_text(a) != render_text(b)


def test_prefix_tracker_cold_then_warm_per_tenant():
    t = PrefixTracker(granule_tokens=4)
    p = list(range(100, 112))
    assert t.observe("a", p, "k") == (0, False)
    assert t.observe("a", p + [1, 2], "k") == (12, True)
    assert t.observe("b", p, "k") == (0, False)  # another tenant: its own first sight
    # without a key: warm once at least half the prompt was sent before
    assert t.observe("a", p[:8] + list(range(200, 208)), None) == (8, True)
    assert t.observe("a", p[:4] + list(range(300, 312)), None) == (4, False)


def test_percentile_interpolates():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile(list(map(float, range(101))), 0.95) == pytest.approx(95.0)


KVTIER_TEXT = """# TYPE kvtier:prefix_cache_hits counter
kvtier:prefix_cache_hits_total{{tier="device"}} {dev}
kvtier:prefix_cache_hits_total{{tier="host"}} {host}
# TYPE kvtier:tier_bytes_read counter
kvtier:tier_bytes_read_total{{tier="host"}} {read}
# TYPE kvtier:recomputed_tokens counter
kvtier:recomputed_tokens_total {rec}
# TYPE kvtier:restore_seconds histogram
kvtier:restore_seconds_bucket{{le="+Inf",tier="host"}} 2.0
kvtier:restore_seconds_sum{{tier="host"}} {rs}
kvtier:restore_seconds_count{{tier="host"}} 2.0
# TYPE kvtier:kv_cache_usage_perc gauge
kvtier:kv_cache_usage_perc {usage}
"""


def test_metric_deltas_and_headline():
    before = M.parse(KVTIER_TEXT.format(dev=10, host=0, read=0, rec=5, rs=0.5, usage=0.1))
    after = M.parse(KVTIER_TEXT.format(dev=30, host=64, read=4096, rec=25, rs=0.75, usage=0.9))
    deltas = M.counter_deltas(before, after)
    h = M.headline(deltas)
    assert h["server"] == "kvtier"
    assert h["prefix_hits_by_tier"] == {"device": 20, "host": 64}
    assert h["bytes_read_by_tier"] == {"host": 4096}
    assert h["recomputed_tokens"] == 20
    assert h["restore_seconds_by_tier"] == {"host": pytest.approx(0.25)}
    assert not any(name.startswith("kvtier:kv_cache_usage") for name, _ in deltas)  # gauges are not differenced
    vllm = M.parse("# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 7\n")
    assert M.headline(M.counter_deltas({}, vllm))["prefix_hits_by_tier"] == {"device": 7}
    other = M.parse("# TYPE http_requests counter\nhttp_requests_total 3\n")
    assert M.headline(M.counter_deltas({}, other)) is None
    assert M.counter_deltas(None, after) is None and M.headline(None) is None


def test_serve_flags_round_trip_through_the_cli():
    from kvtier.cli.main import build_parser, engine_kwargs

    kw = {
        "dtype": "float32",
        "block_size": 4,
        "num_device_blocks": 64,
        "host_cache_bytes": 1 << 20,
        "enable_prefix_caching": True,
        "tier_faults": {"host": "latency_ms=5", "disk": "error_rate=0.1"},
        "disk_cache_dir": "/tmp/x",
        "cache_write_policy": "write_back",
    }
    args = build_parser().parse_args(["serve", "--model", "m", *serve_flags(kw)])
    assert engine_kwargs(args) == {k: v for k, v in kw.items() if k != "enable_prefix_caching"}
    args = build_parser().parse_args(["serve", "--model", "m", *serve_flags({"enable_prefix_caching": False})])
    assert engine_kwargs(args) == {"enable_prefix_caching": False}


def test_bench_command_line_reproduces_the_flags_and_hides_keys():
    from kvtier.bench.cli import command_line
    from kvtier.cli.main import build_parser

    argv = [
        "bench",
        "--url",
        "http://h:1",
        "--api-key",
        "sk-secret",
        "--workload",
        "trace",
        "--trace",
        "t.jsonl",
        "--speedup",
        "2",
        "--concurrency-sweep",
        "1,4",
        "--text-prompts",
    ]
    args = build_parser().parse_args(argv)
    line = command_line(args)
    assert "sk-secret" not in line and "--api-key ..." in line
    for part in (
        "kvtier bench",
        "--url http://h:1",
        "--workload trace",
        "--trace t.jsonl",
        "--speedup 2.0",
        "--concurrency-sweep 1,4",
        "--text-prompts",
    ):
        assert part in line
    assert "--output-tokens" not in line  # defaults are left out
