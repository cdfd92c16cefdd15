"""DiskTier keeps KV private on a shared machine: directories 0700, files 0600, whatever the
umask; a loose directory of ours is tightened, another user's is refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvtier.tiers.disk import DiskTier

from .conftest import FINGERPRINT, make_keys


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o000, 0o022], ids=["umask-000", "umask-022"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "cache" / "kv"  # the tier creates the root and its parent
    tier = DiskTier(root, 1 << 20, fingerprint=FINGERPRINT)
    temp_modes: list[int] = []

    def look_at_temp_files(op: str, key: bytes) -> None:
        if op == "replace":  # the temp file is complete and about to be renamed into place
            temp_modes.extend(mode(p) for p in tier.dir.glob("*/.*.tmp"))

    tier.before_io = look_at_temp_files
    keys = make_keys(20)
    for key in keys:
        assert tier.put(key, key * 100)
    assert temp_modes and set(temp_modes) == {0o600}
    assert mode(root) == 0o700 and mode(tier.dir) == 0o700 and mode(tier.dir / "owners") == 0o700
    fan_out = [p for p in tier.dir.iterdir() if len(p.name) == 2]
    assert len(fan_out) == len({k.hex()[:2] for k in keys}) and {mode(p) for p in fan_out} == {0o700}
    frames = list(tier.dir.glob("*/*.kv"))
    assert len(frames) == 20 and {mode(p) for p in frames} == {0o600}
    # the owner manifests map tenant hashes to block keys: private too, also when their folder
    # was removed under the running tier
    tier.record_owner("a" * 32, keys[:3])
    (tier.dir / "owners" / f"{'a' * 32}.keys").unlink()
    (tier.dir / "owners").rmdir()
    tier.record_owner("b" * 32, keys[3:5])
    assert mode(tier.dir / "owners") == 0o700
    assert mode(tier.dir / "owners" / f"{'b' * 32}.keys") == 0o600
    assert tier.owner_keys("b" * 32) == keys[3:5]


def test_an_existing_root_is_left_alone(tmp_path: Path) -> None:
    """The root may be a shared directory (/var/cache): only what the tier creates is private."""
    os.chmod(tmp_path, 0o755)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    assert mode(tmp_path) == 0o755 and mode(tier.dir) == 0o700


def test_loose_directories_and_files_of_ours_are_tightened_at_start(tmp_path: Path) -> None:
    """A cache written by an older kvtier (0755 directories, 0644 frames) becomes private."""
    keys = make_keys(3)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    for key in keys:
        tier.put(key, key * 100)
    tier.close()
    loose = [tier.dir, tier.dir / "owners", *(p for p in tier.dir.iterdir() if len(p.name) == 2)]
    for path in loose:
        os.chmod(path, 0o755)
    for path in tier.dir.glob("*/*.kv"):
        os.chmod(path, 0o644)

    again = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    assert {mode(p) for p in loose} == {0o700}
    assert {mode(p) for p in again.dir.glob("*/*.kv")} == {0o600}
    assert all(again.get(key) == key * 100 for key in keys)


def test_a_loose_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    fp_dir = tmp_path / FINGERPRINT.hex()
    fp_dir.mkdir(mode=0o755)
    os.chmod(fp_dir, 0o755)
    os.chown(fp_dir, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match=r"owned by uid 65534 .*chmod 700"):
        DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    assert mode(fp_dir) == 0o755  # not changed behind its owner's back
    os.chmod(fp_dir, 0o700)  # private, though not ours: usable (we are root)
    tier = DiskTier(tmp_path, 1 << 20, fingerprint=FINGERPRINT)
    (key,) = make_keys(1)
    assert tier.put(key, b"kv") and tier.get(key) == b"kv"
