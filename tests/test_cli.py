"""The `kvtier` command: the demo end to end, `generate` with tier flags, and usage errors.

The commands run in subprocesses, as a user runs them (`python -m kvtier ...`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli.main import build_parser, engine_kwargs, parse_size

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from kvtier.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("kvtier-cli") / "demo-model")


# ------------------------------------------------------------------ flags, in process
@pytest.mark.parametrize(
    "text,value",
    [
        ("1048576", 1048576),
        ("512MiB", 512 << 20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 << 29),
        ("64k", 64 << 10),
        ("10 kb", 10_000),
        ("7B", 7),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-5MiB", "0", "0.1", "1e9", "MiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_engine_kwargs_only_given_flags():
    parser = build_parser()
    args = parser.parse_args(["generate", "--model", "m", "hi"])
    assert engine_kwargs(args) == {}
    args = parser.parse_args(
        [
            "generate",
            "--model",
            "m",
            "hi",
            "--dtype",
            "float32",
            "--block-size",
            "32",
            "--kv-cache-bytes",
            "64MiB",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--seed",
            "3",
            "--eviction-policy",
            "lfu",
            "--scheduling-policy",
            "priority",
            "--host-cache-bytes",
            "1GiB",
            "--disk-cache-dir",
            "/tmp/x",
            "--disk-cache-bytes",
            "2GB",
            "--remote-cache-url",
            "redis://localhost:6379",
            "--remote-ttl-s",
            "60",
            "--cache-write-policy",
            "write_back",
            "--cache-compression",
            "zstd",
            "--tier-faults",
            "disk=latency_ms=5",
            "--tier-faults",
            "remote=error_rate=0.1",
        ]
    )
    assert engine_kwargs(args) == dict(
        dtype="float32",
        block_size=32,
        kv_cache_bytes=64 << 20,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        seed=3,
        eviction_policy="lfu",
        scheduling_policy="priority",
        host_cache_bytes=1 << 30,
        disk_cache_dir="/tmp/x",
        disk_cache_bytes=2 * 10**9,
        remote_cache_url="redis://localhost:6379",
        remote_ttl_s=60.0,
        cache_write_policy="write_back",
        cache_compression="zstd",
        tier_faults={"disk": "latency_ms=5", "remote": "error_rate=0.1"},
    )
    args = parser.parse_args(["demo", "--no-prefix-caching", "--cache-compression", "none"])
    assert engine_kwargs(args) == {"enable_prefix_caching": False}


def test_engine_flags_match_llm_signature():
    """Every flag maps onto a real LLM(...) parameter."""
    import inspect

    from kvtier import LLM
    from kvtier.cli.main import ENGINE_KEYS, TIER_KEYS

    params = inspect.signature(LLM.__init__).parameters
    assert set(ENGINE_KEYS + TIER_KEYS) <= set(params)


# ------------------------------------------------------------------ subprocesses
def test_demo_end_to_end(tmp_path):
    r = run_cli("demo", "--model-dir", str(tmp_path / "model"), "--prefix-repeats", "2", "--max-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "UNTRAINED" in out
    assert "cold: " in out and "warm: " in out and "cold TTFT" in out
    for row in ("(a) device", "(b) host", "(c) disk", "(d) recompute"):
        assert row in out, out
    summary = json.loads(out.strip().splitlines()[-1])
    for key in (
        "cold_ttft_ms",
        "warm_ttft_ms_median",
        "device_ttft_ms",
        "host_ttft_ms",
        "disk_ttft_ms",
        "recompute_ttft_ms",
    ):
        assert summary[key] > 0, key
    tiers = summary["tiers"]
    assert tiers["device"]["cached_tokens_by_tier"]["device"] > 0
    assert tiers["host"]["cached_tokens_by_tier"].get("host", 0) > 0
    assert tiers["disk"]["cached_tokens_by_tier"].get("disk", 0) > 0
    assert tiers["recompute"]["num_recomputed_tokens"] == summary["prompt_tokens_part_two"]
    assert tiers["host"]["restore_decision"] in ("restore", "partial")
    assert tiers["disk"]["restore_decision"] in ("restore", "partial")
    # the host and disk rows of the printed table show those numbers too
    host_row = next(line for line in out.splitlines() if "(b) host" in line)
    assert str(tiers["host"]["cached_tokens_by_tier"]["host"]) in host_row.split()
    disk_row = next(line for line in out.splitlines() if "(c) disk" in line)
    assert str(tiers["disk"]["cached_tokens_by_tier"]["disk"]) in disk_row.split()
    # the temporary disk directory is gone
    disk_dir = next(w for w in out.split() if "kvtier-demo-disk-" in w)
    assert not Path(disk_dir).exists()


def test_generate_with_tier_flags(demo_model, tmp_path):
    disk = tmp_path / "disk"
    args = [
        "generate",
        "--model",
        str(demo_model),
        "--dtype",
        "float32",
        "--num-device-blocks",
        "64",
        "--max-tokens",
        "2",
        "--host-cache-bytes",
        "64MiB",
        "--disk-cache-dir",
        str(disk),
        "--disk-cache-bytes",
        "256MiB",
        "--cache-compression",
        "lz4",
        "--tier-faults",
        "disk=latency_ms=1",
        "-v",
        "hello tiers " * 30,
    ]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[kvtier] prompt" in r.stderr and "Traceback" not in r.stderr
    assert any(disk.rglob("*")), "the disk tier stored nothing"
    # a second process finds the prompt's blocks on disk
    drop = {"--host-cache-bytes", "64MiB", "--tier-faults", "disk=latency_ms=1"}
    r = run_cli(*[a for a in args if a not in drop])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'disk': " in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--host-cache-bytes", "12XB"],
        ["generate", "--model", "m", "p", "--disk-cache-dir", "/tmp/d", "--disk-cache-bytes", "lots"],
        ["generate", "--model", "m", "p", "--kv-cache-bytes", "-1"],
        ["generate", "--model", "m", "p", "--tier-faults", "gpu=latency_ms=1"],
        ["generate", "--model", "m", "p", "--tier-faults", "disk=latency_ms=abc"],
        ["generate", "--model", "m", "p", "--disk-cache-bytes", "1GiB"],
        ["generate", "--model", "m", "p", "--cache-write-policy", "sometimes"],
        ["demo", "--num-device-blocks", "0"],
    ],
)
def test_bad_values_exit_2(args):
    r = run_cli(*args, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "kvtier: error:" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_missing_model_is_an_error_not_a_traceback(tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "nope"), "--host-cache-bytes", "1MiB", "hi", timeout=120)
    assert r.returncode == 2
    assert "kvtier: error:" in r.stderr and "Traceback" not in r.stderr
