"""kvtier/trace.py: the one Mooncake trace reader (simulator, profiler, bench)."""

from __future__ import annotations

import json

import pytest

from kvtier.trace import TraceRecord, as_records, by_time, json_lines, parse_record, read_trace


def write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_read_trace_keeps_file_order_skips_blank_lines_and_checks_fields(tmp_path):
    recs = [
        {"timestamp": 300, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 100, "input_length": 600, "hash_ids": [1]},
        {"hash_ids": [7, 8, 9]},
    ]
    path = write(tmp_path / "t.jsonl", [json.dumps(recs[0]), "", json.dumps(recs[1]), json.dumps(recs[2])])
    got = read_trace(path)
    assert got == [
        TraceRecord([1, 2], 300.0, 1000, 5),
        TraceRecord([1], 100.0, 600, None),
        TraceRecord([7, 8, 9], None, None, None),
    ]
    assert [r.num_tokens(512) for r in got] == [1000, 600, 3 * 512]  # absent: a full block per id
    assert [r.timestamp_ms for r in by_time(got)] == [None, 100.0, 300.0]  # absent counts as 0


def test_the_limit_stops_reading(tmp_path):
    path = write(tmp_path / "t.jsonl", ['{"hash_ids": [1]}', '{"hash_ids": [2]}', "{not json"])
    assert [r.hash_ids for r in read_trace(path, limit=2)] == [[1], [2]]
    assert read_trace(path, limit=0) == []
    with pytest.raises(ValueError, match=r"t\.jsonl:3 is not JSON"):
        read_trace(path)


@pytest.mark.parametrize(
    "record,message",
    [
        ({"timestamp": 0}, "a Mooncake record needs timestamp, input_length, output_length and hash_ids"),
        ([1, 2], "a Mooncake record needs timestamp"),
        ({"hash_ids": [1, "2"]}, "hash_ids must be a list of integers"),
        ({"hash_ids": 3}, "hash_ids must be a list of integers"),
        ({"hash_ids": [1], "input_length": "many"}, "input_length must be a number"),
        ({"hash_ids": [1], "timestamp": [0]}, "timestamp must be a number"),
    ],
)
def test_bad_records_name_their_line(tmp_path, record, message):
    path = write(tmp_path / "t.jsonl", ['{"hash_ids": [1]}', json.dumps(record)])
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: {message}"):
        read_trace(path)
    with pytest.raises(ValueError, match=rf"record 1: {message}"):
        as_records([{"hash_ids": [1]}, record])
    with pytest.raises(ValueError, match=rf"line 9: {message}"):
        parse_record(record, "line 9")


def test_json_lines_without_a_source_says_line_n():
    assert list(json_lines(["[1]", " ", '{"a": 1}'])) == [(1, [1]), (3, {"a": 1})]
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        list(json_lines(["1", "{oops"]))


def test_every_reader_rejects_a_record_without_hash_ids(tmp_path):
    """The simulator, the bench's trace workload and the profiler share the checks."""
    from kvtier.bench.workloads import WorkloadConfig, trace
    from kvtier.sim import load_trace
    from kvtier.sim.profile import parse_records

    path = write(tmp_path / "t.jsonl", ['{"timestamp": 0, "hash_ids": "abc"}'])
    for read in (
        lambda: load_trace(path),
        lambda: trace(WorkloadConfig(trace=path)),
        lambda: list(parse_records((tmp_path / "t.jsonl").read_text().splitlines())),
    ):
        with pytest.raises(ValueError, match="hash_ids must be a list of integers"):
            read()
