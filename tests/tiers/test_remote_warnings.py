"""What reaches the log at --log-level warning when storage misbehaves, with real conditions:
a disk tier hitting the kernel's file-size limit (EFBIG, a "disk full" kind), and a corrupt
frame on disk. (Redis down and a TLS certificate that does not verify: test_remote_recovery.py
and test_remote_tls.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.tiers.base import HealthGate
from kvtier.tiers.codec import load_tensor, store_tensor
from kvtier.tiers.disk import DiskTier

from .conftest import FINGERPRINT, ManualClock, env_with_repo_on_path, make_keys

FULL_DISK_SCRIPT = """
import logging, resource, signal, sys
from kvtier.tiers.disk import DiskTier
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
tier = DiskTier(sys.argv[1], 1 << 30, fingerprint=bytes(range(16)))
keys = [bytes([i]) * 16 for i in range(3)]
assert tier.put(keys[0], b"small")
assert not tier.put(keys[1], b"x" * (1 << 20)) and not tier.healthy
assert not tier.put(keys[2], b"x" * (1 << 20))  # gated: no second WARNING
print("errors", tier.stats.errors, "skipped", tier.stats.skipped)
"""


def test_disk_full_is_one_warning_naming_the_kind(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path / "disk")],
        capture_output=True,
        text=True,
        env=env_with_repo_on_path(),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, out.stderr
    assert warnings[0].startswith("WARNING tier disk unavailable: disk_full: ")
    assert "File too large" in warnings[0]
    assert warnings[0].endswith("skipping it for 0.5 s, requests recompute")
    assert "errors {'disk_full': 1} skipped 1" in out.stdout


def _corrupt_file(tier: DiskTier, key: bytes) -> None:
    path = next(tier.dir.rglob(key.hex() + "*"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the payload: the checksum fails
    path.write_bytes(bytes(data))


def test_corrupt_entries_are_warned_rate_limited(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.base")
    clock = ManualClock()
    tier = DiskTier(tmp_path / "disk", 1 << 24, fingerprint=FINGERPRINT, health=HealthGate(clock=clock))
    keys = make_keys(3)
    kv = torch.ones(2, 4, 2, 8, dtype=torch.bfloat16)
    for key in keys:
        assert store_tensor(tier, key, kv, fingerprint=FINGERPRINT)
        _corrupt_file(tier, key)
    assert load_tensor(tier, keys[0], fingerprint=FINGERPRINT) is None
    assert load_tensor(tier, keys[1], fingerprint=FINGERPRINT) is None  # within 60 s: quiet
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith(f"tier disk: corrupt entry {keys[0].hex()}")
    clock.advance(60)
    assert load_tensor(tier, keys[2], fingerprint=FINGERPRINT) is None
    assert caplog.records[-1].getMessage().endswith("(1 more since the last report)")
    assert tier.stats.corrupt == 3 and tier.contains_prefix(keys) == 0  # deleted
