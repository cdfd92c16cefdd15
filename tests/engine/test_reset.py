"""kvtier.engine.reset over a real engine with host and disk tiers: a reset empties the tiers it
names, keeps the blocks a running request holds (and that request runs on to the same tokens),
and leaves the engine's invariants intact; a prompt seen before is a miss right after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier import LLM, SamplingParams
from kvtier.engine.reset import begin_reset, check_tiers

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
A = list(range(10, 40))
B = list(range(50, 80))


@pytest.fixture
def tiered(byte_model_dir: Path, tmp_path: Path):
    with LLM(
        str(byte_model_dir),
        dtype="float32",
        num_device_blocks=96,
        block_size=4,
        host_cache_bytes=4 << 20,
        disk_cache_dir=str(tmp_path / "disk"),
    ) as llm:
        yield llm


def run(core, prompt: list[int], params: SamplingParams):
    rid = core.add_request(prompt, params)
    while True:
        for out in core.step():
            if out.request_id == rid and out.finished:
                return out


def settled(future):
    return future.result(timeout=60) if future is not None else None


def test_reset_clears_the_named_tiers_and_keeps_running_blocks(tiered):
    core = tiered.engine
    run(core, A, GREEDY)
    core.tiers.flush()
    host, disk = core.tiers.tiers["host"], core.tiers.tiers["disk"]
    num_host, num_disk = len(list(host.keys())), len(disk)
    assert num_host > 0 and num_disk > 0

    running = core.add_request(B, LONG)
    for _ in range(3):  # B's prompt is computed and it decodes: its blocks are held
        core.step()
    nodes_before = sum(1 for _ in core.kv.index.nodes())
    now, future = begin_reset(core, ["device", "host", "disk"])
    answer = settled(future)
    device = now["tiers"]["device"]
    assert device["blocks_in_use"] > 0 and device["blocks"] + device["blocks_in_use"] == nodes_before
    assert device["bytes"] == device["blocks"] * core.runner.kv_bytes_per_block
    assert answer["tiers"]["device"] == device and answer["not_configured"] == []
    assert answer["tiers"]["host"]["blocks"] >= num_host and answer["tiers"]["disk"]["blocks"] >= num_disk
    assert len(list(host.keys())) == 0 and len(disk) == 0
    core.check_integrity()

    # the running request goes on, to the tokens it makes without any reset
    out = None
    while core.has_unfinished:
        for o in core.step():
            if o.request_id == running and o.finished:
                out = o
    assert out is not None and out.outputs[0].finish_reason == "length"
    alone = run(core, B, LONG)
    assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    core.check_integrity()

    # A is a miss in every tier right after its reset, and a hit again the time after
    core.tiers.flush()
    settled(begin_reset(core, None)[1])  # the default: device, host, disk
    assert run(core, A, GREEDY).num_cached_tokens == 0
    assert run(core, A, GREEDY).num_cached_tokens > 0
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_reset_of_the_device_alone_keeps_the_tiers(tiered):
    core = tiered.engine
    run(core, A, GREEDY)
    core.tiers.flush()
    num_host = len(list(core.tiers.tiers["host"].keys()))
    now, future = begin_reset(core, ["device"])
    assert future is None and set(now["tiers"]) == {"device"} and now["tiers"]["device"]["blocks"] > 0
    assert len(list(core.tiers.tiers["host"].keys())) == num_host
    out = run(core, A, GREEDY)  # restored from below the device
    assert out.num_cached_tokens > 0 and "device" not in {k for k, v in out.cached_tokens_by_tier.items() if v}
    core.check_integrity()


def test_tiers_named_that_are_not_there(byte_model_dir):
    with LLM(str(byte_model_dir), dtype="float32", num_device_blocks=64, block_size=4) as llm:
        now, future = begin_reset(llm.engine, ["device", "remote"])
        assert future is None and now["not_configured"] == ["remote"] and set(now["tiers"]) == {"device"}
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        check_tiers(["device", "gpu"])
    with pytest.raises(ValueError, match="at least one"):
        check_tiers([])
    assert check_tiers(["disk", "device", "disk"]) == ["device", "disk"]
