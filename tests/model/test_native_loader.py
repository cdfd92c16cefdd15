"""The native-kernel loader builds into a private folder and never loads a library someone else
could have planted: a foreign folder is refused (no shared-temp fallback), a foreign or
writable-by-others library is rebuilt over, and concurrent builds compile once."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from kvtier.model import native

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on PATH"
)

NOBODY = 65534

TINY_C = "int kvt_abi_version(void) { return %d; }\n"


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(root))
    return root


@pytest.fixture
def tiny_source(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "tiny.c"
    src.parent.mkdir()
    src.write_text(TINY_C % 7)
    return src


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_build_folder_and_library_are_private(cache_root: Path, tiny_source: Path) -> None:
    old = os.umask(0)  # a careless umask must not make them readable or writable by others
    try:
        path = native._build(tiny_source)
    finally:
        os.umask(old)
    assert path.parent == cache_root / "native"
    assert _mode(path.parent) == 0o700
    assert _mode(path) & 0o077 == 0 and os.lstat(path).st_uid == os.getuid()
    assert ctypes.CDLL(str(path)).kvt_abi_version() == 7


def test_our_own_loose_folder_is_tightened(cache_root: Path, tiny_source: Path) -> None:
    (cache_root / "native").mkdir(parents=True)
    os.chmod(cache_root / "native", 0o777)
    native._build(tiny_source)
    assert _mode(cache_root / "native") == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a folder owned by another user")
def test_a_folder_owned_by_another_user_is_refused_without_fallback(cache_root: Path, tiny_source: Path) -> None:
    (cache_root / "native").mkdir(parents=True)
    os.chown(cache_root / "native", NOBODY, NOBODY)
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(RuntimeError, match="belongs to uid"):
        native._build(tiny_source)
    assert os.listdir(cache_root / "native") == []  # nothing built there
    new = set(os.listdir(tempfile.gettempdir())) - before
    assert not [n for n in new if n.startswith("kvtier")]  # and nothing in the shared temp folder


def test_a_link_as_the_folder_is_refused(cache_root: Path, tiny_source: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache_root.mkdir()
    os.symlink(elsewhere, cache_root / "native")
    with pytest.raises(RuntimeError, match="not a directory"):
        native._build(tiny_source)
    assert os.listdir(elsewhere) == []


def _planted(cache_root: Path, tiny_source: Path, tmp_path: Path) -> Path:
    """Build once to learn the target name, then replace it with a different library (one that
    answers 99): what an attacker would leave there."""
    target = native._build(tiny_source)
    evil_src = tmp_path / "evil.c"
    evil_src.write_text(TINY_C % 99)
    evil_so = tmp_path / "evil.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    assert os.system(f"{cc} -shared -fPIC {evil_src} -o {evil_so}") == 0
    os.replace(evil_so, target)
    return target


@pytest.mark.parametrize("how", ["writable_by_others", "foreign_owner", "symlink"])
def test_a_planted_library_is_rebuilt_not_loaded(
    cache_root: Path, tiny_source: Path, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    target = _planted(cache_root, tiny_source, tmp_path)
    if how == "writable_by_others":
        os.chmod(target, 0o777)
    elif how == "foreign_owner":
        if os.getuid() != 0:
            pytest.skip("needs root to chown")
        os.chown(target, NOBODY, NOBODY)
    else:
        real = tmp_path / "real.so"
        os.replace(target, real)
        os.symlink(real, target)
    with caplog.at_level("WARNING", logger="kvtier.model.native"):
        path = native._build(tiny_source)
    assert path == target
    assert "refusing to load" in caplog.text
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o022 == 0
    assert ctypes.CDLL(str(path)).kvt_abi_version() == 7  # our build, not the planted one


def test_concurrent_builds_compile_once(cache_root: Path, tiny_source: Path, monkeypatch) -> None:
    compiles = []
    real_run = native.subprocess.run

    def counting_run(cmd, *args, **kwargs):
        if "-shared" in cmd:
            compiles.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting_run)
    results: list[Path] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def build() -> None:
        try:
            start.wait()
            results.append(native._build(tiny_source))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1 and len(compiles) == 1
    leftovers = [n for n in os.listdir(cache_root / "native") if n.endswith(".so") and n != results[0].name]
    assert leftovers == []
