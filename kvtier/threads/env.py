"""On/off environment switches: one spelling rule for every KVTIER_* switch (a bad value is an
error that names the variable, never a silent default)."""

from __future__ import annotations

import os
from collections.abc import Mapping

_SWITCH_ON = ("1", "true", "yes", "on")
_SWITCH_OFF = ("0", "false", "no", "off")


def env_switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off environment variable, on when unset or empty: 1/true/yes/on or 0/false/no/off
    (any case); any other value is a ValueError that names the variable, never a silent default."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in _SWITCH_OFF:
        return False
    if value == "" or value in _SWITCH_ON:
        return True
    raise ValueError(f"{name} must be one of 1/true/yes/on or 0/false/no/off, got {raw!r}")
