"""Argument types of the `kvtier` flags shared by its subcommands (`kvtier bench` included).

Each takes the flag's text and returns the value, or raises argparse.ArgumentTypeError with a
message that says what to give (`parse_size`, the parser behind `size`, raises ValueError for
callers outside argparse). Standard library only: any command module may import it without
importing the others.
"""

from __future__ import annotations

import argparse
import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A byte count: "1048576", "512MiB", "2GB", "1.5GiB", "64k".

    KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of 1024; KB/MB/GB/TB are powers of 1000.
    """
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}; use bytes or a unit, e.g. 1048576, 512MiB, 2GB")
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if value < 1:
        raise ValueError(f"invalid size {text!r}; must be at least 1 byte")
    return int(value)


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    values = []
    for part in text.split(","):
        part = part.strip()
        if part:
            values.append(positive_int(part))
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return tuple(values)


def port(text: str) -> int:
    value = integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value
