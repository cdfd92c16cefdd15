"""Mooncake-format request traces: the one reader the simulator, the profiler and the bench use.

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` in ms, ``input_length`` and ``output_length`` in tokens, ``hash_ids`` one opaque
id per block of the input (512 tokens in the published traces), chained: equal ids at the same
position mean an equal prefix. Only ``hash_ids`` is required; each caller decides what a
missing field means (see `TraceRecord`). Pure Python: no kvtier module is imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = "timestamp, input_length, output_length and hash_ids"


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace, checked; None: the record does not give the field."""

    hash_ids: list[int]
    timestamp_ms: float | None = None
    input_length: int | None = None
    output_length: int | None = None

    def num_tokens(self, block_tokens: int) -> int:
        """`input_length`, or one full block of `block_tokens` per hash id when it is absent."""
        return self.input_length if self.input_length is not None else len(self.hash_ids) * block_tokens

    @property
    def time_ms(self) -> float:
        """`timestamp_ms`, 0 when absent (the sort key of `by_time`)."""
        return 0.0 if self.timestamp_ms is None else self.timestamp_ms


def parse_record(obj: Any, where: str) -> TraceRecord:
    """Check one decoded record; `where` ("trace.jsonl:3", "line 3") prefixes every error.

    Raises ValueError unless `obj` is an object with a list of integer `hash_ids` and, where
    present and not null, numeric `timestamp`, `input_length` and `output_length`."""
    if not isinstance(obj, Mapping) or "hash_ids" not in obj:
        raise ValueError(f"{where}: a Mooncake record needs {FIELDS}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    return TraceRecord(
        list(ids),
        _number(obj, "timestamp", float, where),
        _number(obj, "input_length", int, where),
        _number(obj, "output_length", int, where),
    )


def _number(obj: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = obj.get(name)
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}") from None


def json_lines(lines: Iterable[str], source: str | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) of every non-blank line. A line that is not JSON raises
    ValueError naming it as "SOURCE:N", or "line N" without a source."""
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            where = f"{source}:{n}" if source is not None else f"line {n}"
            raise ValueError(f"{where} is not JSON: {e.msg} (column {e.colno})") from None
        yield n, obj


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The first `limit` records (all: None) of a trace file, in file order; blank lines are
    skipped, and reading stops at the limit."""
    records: list[TraceRecord] = []
    if limit is not None and limit <= 0:
        return records
    with open(path, encoding="utf-8") as f:
        for n, obj in json_lines(f, str(path)):
            records.append(parse_record(obj, f"{path}:{n}"))
            if limit is not None and len(records) >= limit:
                break
    return records


def as_records(items: Iterable[Mapping[str, Any] | TraceRecord]) -> list[TraceRecord]:
    """Records given in code (decoded dicts or TraceRecords), checked as a file's would be."""
    return [r if isinstance(r, TraceRecord) else parse_record(r, f"record {i}") for i, r in enumerate(items)]


def by_time(records: Iterable[TraceRecord]) -> list[TraceRecord]:
    """Sorted by timestamp (absent: 0); stable, so equal timestamps keep their order."""
    return sorted(records, key=lambda r: r.time_ms)
