"""The simulator predicts what the engine does: a small trace replayed through `kvtier.sim` and
through the real engine (tiny model, device pool + host tier + disk tier, each small enough to
evict) gives the same hits per tier, the same evictions, and the same blocks left in each tier,
in the same LRU order, under write-through, write-back and selective.

Trace -> tokens: block i of a request holds tokens derived from its hash id, and no two hash ids
share a first token (no token-granular partial hits). The engine's prompt is the trace's full
blocks plus one unique token (the last prompt token is always computed), so both sides reuse
exactly the full blocks. The engine holds that one extra token's block while a request runs, so
the simulator gets one block less of device capacity. The engine runs one request at a time,
restores whatever is stored (restore_policy="always": no measured speed decides), has one I/O
thread (the order the simulator's serial executor follows) and its stores are flushed before
the next request arrives (the simulator's stores complete at once).
"""

from __future__ import annotations

import os
import random

import pytest

from kvtier.config import CacheConfig, EngineConfig, ModelConfig
from kvtier.kvcache.keys import chain_keys, root_key
from kvtier.sampling_params import SamplingParams
from kvtier.sim import TraceSimulator, load_trace
from kvtier.tiers.hierarchy import TierConfig

BS = 4
DEVICE_BLOCKS = 12
SP = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def make_trace(seed: int = 0, n: int = 60) -> list[dict]:
    rng = random.Random(seed)
    convs = [[c * 100 + j for j in range(rng.randint(1, 3))] for c in range(8)]  # 8 conversations, growing
    trace, next_id = [], 1000
    for t in range(n):
        c = rng.randrange(len(convs))
        ids = convs[c] + [next_id + k for k in range(rng.randrange(1, 3))]
        next_id += 10
        if rng.random() < 0.5 and len(ids) <= 4:
            convs[c] = ids  # the conversation continues
        trace.append({"timestamp": t, "input_length": len(ids) * BS, "output_length": 1, "hash_ids": ids})
    return trace


def prompts_for(trace: list[dict]) -> list[list[int]]:
    """Tokens per request: equal hash ids give equal blocks; every id its own first token."""
    first: dict[int, int] = {}
    out = []
    for i, rec in enumerate(trace):
        toks = []
        for h in rec["hash_ids"]:
            rng = random.Random(h)
            toks += [3 + first.setdefault(h, len(first))] + [rng.randrange(3, 500) for _ in range(BS - 1)]
        out.append(toks + [500 + i % 10])
    assert len(first) < 497
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvtier.model.builder import build_random_llama

    d = tmp_path_factory.mktemp("sim_model")
    build_random_llama(
        d,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=512,
        max_position_embeddings=512,
        dtype="float32",
    )
    return d


@pytest.fixture(scope="module")
def sizes(model_dir) -> tuple[int, int]:
    """(KV bytes of one block, bytes of its disk frame) for this model."""
    from kvtier.engine.core import EngineCore
    from kvtier.tiers.codec import encode

    eng = EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(block_size=BS, num_device_blocks=DEVICE_BLOCKS),
        )
    )
    frame = encode(eng.runner.read_block(0), fingerprint=eng.runner.fingerprint, key=bytes(16))
    return eng.runner.kv_bytes_per_block, len(frame)


def alloc_unit(path) -> int:
    """The file system's allocation unit under `path`, as DiskTier reads it."""
    return max(512, os.stat(path).st_blksize or 4096)


def run_engine(model_dir, tmp_path, trace, write_policy, host_blocks, disk_blocks, sizes):
    from kvtier.engine.core import EngineCore

    block_bytes, frame_bytes = sizes
    unit = alloc_unit(tmp_path)
    charge = -(-frame_bytes // unit) * unit  # the disk tier counts what the file system allocates
    tiers = TierConfig(
        host_cache_bytes=host_blocks * block_bytes,
        disk_cache_dir=str(tmp_path / "disk") if disk_blocks else None,
        disk_cache_bytes=disk_blocks * charge + charge // 2 if disk_blocks else None,
        cache_write_policy=write_policy,
        restore_policy="always",
        io_threads=1,
    )
    eng = EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32"),
            cache=CacheConfig(block_size=BS, num_device_blocks=DEVICE_BLOCKS),
            tiers=tiers,
        )
    )
    root = root_key(eng.runner.fingerprint)
    hits = {"device": 0, "host": 0, "disk": 0}
    key_names: dict[bytes, bytes] = {}  # engine block key -> simulator block key
    for prompt, req in zip(prompts_for(trace), load_trace(trace, block_tokens=BS)):
        key_names.update(zip(chain_keys(root, prompt, BS, num_blocks=len(req.keys)), req.keys))
        rid = eng.add_request(prompt, SP)
        out = None
        while eng.has_unfinished:
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    out = o
        eng.tiers.flush()
        for tier, num_tokens in out.cached_tokens_by_tier.items():
            hits[tier] += num_tokens // BS
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    stats = eng.tiers.tier_stats()
    left = {name: [key_names[k] for k in tier.keys()] for name, tier in eng.tiers.tiers.items()}
    evictions = {name: s.evictions for name, s in stats.items()}
    eng.close()
    return hits, evictions, left


CASES = [  # (write policy, host blocks, disk blocks); the device holds 12
    ("write_through", 200, 0),  # a host tier that never evicts
    ("write_through", 12, 0),
    ("write_through", 12, 30),
    ("write_back", 12, 30),  # seeds 0 and 1: a promotion evicts a host block the same load wanted
    ("selective", 12, 30),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("write_policy,host_blocks,disk_blocks", CASES)
def test_simulator_and_engine_agree_per_tier(model_dir, sizes, tmp_path, seed, write_policy, host_blocks, disk_blocks):
    trace = make_trace(seed)
    sim = TraceSimulator(
        DEVICE_BLOCKS - 1,
        block_tokens=BS,
        block_bytes=sizes[0],
        host_blocks=host_blocks,
        disk_blocks=disk_blocks or None,
        disk_alloc_bytes=alloc_unit(tmp_path),
        write_policy=write_policy,
        restore_policy="always",
    )
    sim.replay(load_trace(trace, block_tokens=BS))
    sim.check_integrity()
    p = sim.result()

    hits, evictions, left = run_engine(model_dir, tmp_path, trace, write_policy, host_blocks, disk_blocks, sizes)

    assert p.device_hit_blocks > 0 and p.host_hit_blocks + p.disk_hit_blocks > 0  # the trace uses the tiers
    if host_blocks < 100 and write_policy != "selective":
        assert p.host_evictions > 0 and (not disk_blocks or p.disk_hit_blocks > 0)  # ... and evicts
    assert hits == {"device": p.device_hit_blocks, "host": p.host_hit_blocks, "disk": p.disk_hit_blocks}
    assert evictions == {"host": p.host_evictions, **({"disk": p.disk_evictions} if disk_blocks else {})}
    assert left["host"] == list(sim.host.keys())  # same blocks, same LRU order
    if disk_blocks:
        assert left["disk"] == list(sim.disk.keys())
