"""The offline `LLM(...)` with vLLM's arguments: hub ids found in the local Hugging Face cache
(never downloaded), `revision`, `download_dir`, vLLM's no-op arguments, and
`gpu_memory_utilization` with vLLM's meaning (the instance's share of the machine)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvtier import LLM, SamplingParams
from kvtier.model.resolve import hf_cache_dir, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def model_dir(byte_model_dir: Path) -> Path:
    """The engine tests' tiny float32 Llama (tests/engine/conftest.py)."""
    return byte_model_dir


def make_hub_cache(root: Path, repo_id: str, model_dir: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """`huggingface_hub`'s cache layout: models--org--name/refs/<ref> -> commit, the files under
    snapshots/<commit>/ (links to blobs there; links to the model's files here)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = snap / f.name
        if not link.exists():
            link.symlink_to(f)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def test_resolve_local_paths_and_hub_ids(tmp_path, model_dir):
    assert resolve_model(str(model_dir)) == str(model_dir)
    hub = tmp_path / "hub"
    snap = make_hub_cache(hub, "acme/tiny-chat", model_dir)
    assert resolve_model("acme/tiny-chat", download_dir=str(hub)) == str(snap)
    assert resolve_model("acme/tiny-chat", revision=COMMIT, download_dir=str(hub)) == str(snap)
    other = make_hub_cache(hub, "acme/tiny-chat", model_dir, commit=OTHER, ref="v2")
    assert resolve_model("acme/tiny-chat", revision="v2", download_dir=str(hub)) == str(other)
    with pytest.raises(ValueError, match=r"revision 'v3' is not in the cache .*cached refs: main, v2"):
        resolve_model("acme/tiny-chat", revision="v3", download_dir=str(hub))
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache .* kvtier does not download"):
        resolve_model("acme/not-cached", download_dir=str(hub))
    with pytest.raises(ValueError, match="no such file or directory, and not a hub id"):
        resolve_model(str(tmp_path / "missing" / "model"))
    with pytest.raises(ValueError, match="is a local path, not a hub id"):
        resolve_model(str(model_dir), revision="main")


def test_a_gguf_only_snapshot_resolves_to_its_file(tmp_path):
    repo = tmp_path / "models--acme--tiny-GGUF"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (snap / "tiny.Q4_1.gguf").write_bytes(b"GGUF")
    assert resolve_model("acme/tiny-GGUF", download_dir=str(tmp_path)) == str(snap / "tiny.Q4_1.gguf")
    (snap / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model("acme/tiny-GGUF", download_dir=str(tmp_path))


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert hf_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hc"))
    assert hf_cache_dir() == tmp_path / "hc"
    assert hf_cache_dir(str(tmp_path / "dl")) == tmp_path / "dl"


def test_llm_serves_a_cached_hub_id_as_its_directory(tmp_path, model_dir, monkeypatch):
    """LLM("org/name") reads the cached snapshot (HF_HOME here) and generates what the
    directory itself generates; vLLM's no-op arguments are taken."""
    make_hub_cache(tmp_path / "hf" / "hub", "acme/tiny-chat", model_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with LLM(str(model_dir), dtype="float32", num_device_blocks=32, block_size=4) as ref:
        want = ref.generate(["hello there"], params)[0].outputs[0].token_ids
    with LLM(
        "acme/tiny-chat",
        dtype="float32",
        num_device_blocks=32,
        block_size=4,
        tensor_parallel_size=1,
        trust_remote_code=True,
        enforce_eager=True,
        load_format="auto",
        disable_log_stats=True,
    ) as llm:
        assert llm.model_name == "acme/tiny-chat"
        assert llm.generate(["hello there"], params)[0].outputs[0].token_ids == want
        llm.check_integrity()


def test_llm_refuses_what_it_cannot_do(model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 2: not supported"):
        LLM(str(model_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config is not supported"):
        LLM(str(model_dir), speculative_config={"method": "ngram"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_paralel_size'"):
        LLM(str(model_dir), tensor_paralel_size=1)
    with pytest.raises(ValueError, match="exclude each other"):
        LLM(str(model_dir), gpu_memory_utilization=0.5, kv_cache_memory_fraction=0.2)
    with pytest.raises(ValueError, match="give one"):
        LLM(str(model_dir), kv_cache_bytes=1 << 20, kv_cache_memory_bytes=2 << 20)


def _total_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_gpu_memory_utilization_is_the_instances_share_of_the_machine(model_dir):
    """vLLM's meaning: the instance may use this share of all memory, what it holds already
    included; the pool gets the rest less a working reserve. Asked for ~48 MiB beyond what this
    process holds and the reserve, the pool is about that size."""
    from kvtier.model.runner import _total_memory_bytes

    total = _total_memory_bytes(__import__("torch").device("cpu"))
    assert 0 < total <= _total_memory()
    rss = _rss()
    reserve = 256 << 20
    share = (rss + reserve + (48 << 20)) / total
    assert share < 0.5  # the test machine holds far more than this process
    with LLM(str(model_dir), dtype="float32", block_size=4, gpu_memory_utilization=share) as llm:
        runner = llm.engine.runner
        pool = llm.num_device_blocks * runner.kv_bytes_per_block
        assert 8 << 20 < pool <= 64 << 20, pool
        llm.generate(["abc"], SamplingParams(max_tokens=2))
        llm.check_integrity()


def test_gpu_memory_utilization_too_small_for_the_weights(model_dir):
    share = (64 << 20) / _total_memory()  # 64 MiB: less than the process already holds
    with pytest.raises(ValueError, match="no room for the KV cache; raise it, or size the pool with --kv-cache-bytes"):
        LLM(str(model_dir), dtype="float32", gpu_memory_utilization=share)


def test_override_generation_config(model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5}')
    with LLM(
        str(d),
        dtype="float32",
        num_device_blocks=16,
        block_size=4,
        override_generation_config={"temperature": 0.2, "max_tokens": 3},
    ) as llm:
        sp = llm.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.2, 0.9, 3)
    with pytest.raises(ValueError, match="unknown key 'beams'"):
        LLM(str(d), override_generation_config={"beams": 2})
