"""The engine with tiers below the device pool: the same tokens whichever tier the KV came
from, warm starts, faults that degrade to recompute, and the cost model's choices. Every
scenario ends with check_integrity() and no leaked blocks."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.identity import Tenancy
from kvtier.tiers.codec import encode

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvtier.model.builder import build_random_llama

    d = tmp_path_factory.mktemp("tier_model")
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=1024,
        dtype="float32",
        seed=3,
    )
    return d


def prompts(seed: int, n: int, length: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def expected(model_dir):
    """Tokens computed with no cache at all."""
    llm = LLM(str(model_dir), dtype="float32", num_device_blocks=512, block_size=BS, enable_prefix_caching=False)
    cache: dict[tuple, list[int]] = {}

    def get(p: list[int]) -> list[int]:
        if tuple(p) not in cache:
            cache[tuple(p)] = llm.generate(p, SP)[0].outputs[0].token_ids
        return cache[tuple(p)]

    return get


def engine(model_dir, **kw) -> LLM:
    """An engine that restores whatever is stored (the cost model has its own tests below)."""
    args = dict(dtype="float32", num_device_blocks=40, block_size=BS, restore_policy="always")
    args.update(kw)
    return LLM(str(model_dir), **args)


def done(llm: LLM) -> None:
    llm.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    llm.close()


def evict_device(llm: LLM, seed: int = 99) -> None:
    """Serve enough unrelated prompts to push everything else out of the device pool."""
    llm.generate(prompts(seed, 5), SP)


def test_same_tokens_from_device_host_disk_remote_and_recompute(model_dir, expected, tmp_path, redis_server):
    ps = prompts(1, 3)
    want = [expected(p) for p in ps]
    llm = engine(
        model_dir,
        num_device_blocks=64,
        host_cache_bytes=64 << 20,
        disk_cache_dir=str(tmp_path / "d"),
        remote_cache_url=redis_server.url,
    )
    assert [o.outputs[0].token_ids for o in llm.generate(ps, SP)] == want
    # device
    o = llm.generate(ps[0], SP)[0]
    assert o.cached_tokens_by_tier["device"] == 59 and o.outputs[0].token_ids == want[0]
    # host
    evict_device(llm)
    o = llm.generate(ps[1], SP)[0]
    assert o.cached_tokens_by_tier.get("host") == 56, o.cached_tokens_by_tier
    assert o.restore_decision == "restore" and o.outputs[0].token_ids == want[1]
    assert o.num_recomputed_tokens == 60 - 56
    llm.engine.tiers.flush()
    done(llm)
    # disk: a new process-like engine on the same directory, no host tier
    llm = engine(model_dir, disk_cache_dir=str(tmp_path / "d"))
    o = llm.generate(ps[2], SP)[0]
    assert o.cached_tokens_by_tier.get("disk") == 56 and o.outputs[0].token_ids == want[2]
    done(llm)
    # remote: a new engine sharing the Redis server
    llm = engine(model_dir, remote_cache_url=redis_server.url)
    outs = llm.generate(ps, SP)
    assert [o.cached_tokens_by_tier.get("remote") for o in outs] == [56, 56, 56]
    assert [o.outputs[0].token_ids for o in outs] == want
    done(llm)


def test_matches_transformers_after_a_host_restore(tiny_model_dirs, reference_model):
    d = tiny_model_dirs["llama"]
    ref = reference_model(d)
    p = prompts(2, 1, 40)[0]
    with torch.no_grad():
        ids = list(p)
        for _ in range(8):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(str(d), dtype="float32", num_device_blocks=24, block_size=BS, host_cache_bytes=16 << 20)
    llm.generate(p, SP)
    llm.generate(prompts(98, 2, 40), SP)
    o = llm.generate(p, SP)[0]
    assert o.cached_tokens_by_tier.get("host", 0) > 0
    assert o.outputs[0].token_ids == ids[40:]
    done(llm)


def test_partial_restore_host_then_recompute_past_a_slow_disk(model_dir, expected, tmp_path):
    p = prompts(3, 1)[0]
    block_bytes = None
    llm = engine(
        model_dir, host_cache_bytes=1 << 30, disk_cache_dir=str(tmp_path / "d"), tier_faults={"disk": "latency_ms=300"}
    )
    block_bytes = llm.engine.runner.kv_bytes_per_block
    llm.close()
    # host keeps only 5 blocks (the head of the prefix: stores go tail first); disk has them all
    llm = engine(
        model_dir,
        host_cache_bytes=5 * block_bytes,
        disk_cache_dir=str(tmp_path / "d"),
        tier_faults={"disk": "latency_ms=300"},
        restore_policy="cost",
    )
    llm.generate(p, SP)
    llm.engine.tiers.flush()
    assert llm.reset_prefix_cache() > 0
    llm.engine.tiers.cost.prefill.theta = [1e-3, 1e-8]  # recomputing a block: ~4 ms << 300 ms
    o = llm.generate(p, SP)[0]
    assert o.restore_decision == "partial", o
    # host holds blocks 0-3 (block 4 made room for block 15, written by a later decode step)
    assert o.cached_tokens_by_tier == {"device": 0, "host": 16}
    assert o.outputs[0].token_ids == expected(p)
    done(llm)


def test_cost_model_recomputes_short_prefixes_and_restores_long_ones_from_slow_storage(model_dir, expected, tmp_path):
    # Model a slow accelerator (5 ms a token: 20 ms a block) against a disk with 15 ms a call:
    # a lookup plus one read per block. Two blocks do not pay for the lookup; 49 blocks do.
    short, long = prompts(4, 1, 12)[0], prompts(5, 1, 200)[0]
    faults = {"disk": "latency_ms=15"}
    llm = engine(model_dir, num_device_blocks=120, disk_cache_dir=str(tmp_path / "d"))
    llm.generate([short, long], SP)
    llm.engine.tiers.flush()
    done(llm)
    llm = engine(
        model_dir, num_device_blocks=120, disk_cache_dir=str(tmp_path / "d"), tier_faults=faults, restore_policy="cost"
    )
    est = llm.engine.tiers.cost.prefill
    est.theta, est.frozen = [5e-3, 0.0], True
    o_short = llm.generate(short, SP)[0]
    o_long = llm.generate(long, SP)[0]
    assert o_short.restore_decision == "recompute" and o_short.num_cached_tokens == 0
    assert o_long.restore_decision == "restore" and o_long.cached_tokens_by_tier["disk"] == 196
    assert o_short.outputs[0].token_ids == expected(short)
    assert o_long.outputs[0].token_ids == expected(long)
    assert llm.engine.scheduler.restore_decisions["recompute"] >= 1
    done(llm)


def test_corrupt_disk_entries_are_misses_and_output_stays_right(model_dir, expected, tmp_path):
    p = prompts(6, 1)[0]
    root = tmp_path / "d"
    llm = engine(model_dir, disk_cache_dir=str(root))
    llm.generate(p, SP)
    llm.engine.tiers.flush()
    done(llm)
    files = sorted(root.rglob("*.kv"))
    assert len(files) == 16  # 60 prompt + 7 generated tokens computed: 16 full blocks
    for f in files[::3]:  # flip bytes in the middle of every third file
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    llm = engine(model_dir, disk_cache_dir=str(root))
    o = llm.generate(p, SP)[0]
    assert o.outputs[0].token_ids == expected(p)
    assert llm.engine.tiers.tier_stats()["disk"].corrupt >= 1
    assert o.cached_tokens_by_tier.get("disk", 0) < 56
    done(llm)


def test_redis_killed_mid_run_falls_back_to_recompute(model_dir, expected, redis_server):
    ps = prompts(7, 4)
    llm = engine(model_dir, remote_cache_url=redis_server.url)
    llm.generate(ps[:2], SP)
    llm.engine.tiers.flush()
    redis_server.kill()
    outs = llm.generate(ps, SP)  # lookups and stores fail: everything is recomputed, correctly
    assert [o.outputs[0].token_ids for o in outs] == [expected(p) for p in ps]
    assert not llm.engine.tiers.tiers["remote"].healthy
    done(llm)


def test_disk_errors_degrade_to_recompute(model_dir, expected, tmp_path):
    p = prompts(8, 1)[0]
    llm = engine(model_dir, disk_cache_dir=str(tmp_path / "d"), tier_faults={"disk": "error_rate=1.0"})
    o1 = llm.generate(p, SP)[0]
    evict_device(llm)
    o2 = llm.generate(p, SP)[0]
    assert o1.outputs[0].token_ids == o2.outputs[0].token_ids == expected(p)
    assert o2.cached_tokens_by_tier.get("disk", 0) == 0
    assert llm.engine.tiers.tier_stats()["disk"].num_errors >= 1
    done(llm)


def test_redis_cluster_tier(model_dir, expected, cluster_url):
    ps = prompts(9, 3)
    llm = engine(model_dir, remote_cache_url=cluster_url)
    llm.generate(ps, SP)
    llm.engine.tiers.flush()
    done(llm)
    llm = engine(model_dir, remote_cache_url=cluster_url)
    outs = llm.generate(ps, SP)
    assert [o.cached_tokens_by_tier.get("remote") for o in outs] == [56, 56, 56]
    assert [o.outputs[0].token_ids for o in outs] == [expected(p) for p in ps]
    done(llm)


def test_write_back_stores_on_eviction_only(model_dir, expected, tmp_path):
    p = prompts(10, 1)[0]
    llm = engine(model_dir, host_cache_bytes=64 << 20, cache_write_policy="write_back")
    llm.generate(p, SP)
    assert llm.engine.tiers.tier_stats()["host"].puts == 0
    evict_device(llm)
    assert llm.engine.tiers.tier_stats()["host"].puts > 0
    o = llm.generate(p, SP)[0]
    assert o.cached_tokens_by_tier.get("host") == 56 and o.outputs[0].token_ids == expected(p)
    done(llm)


def test_selective_stores_after_repeated_hits(model_dir, expected):
    p = prompts(11, 1)[0]
    llm = engine(model_dir, host_cache_bytes=64 << 20, cache_write_policy="selective")
    llm.generate(p, SP)
    llm.generate(p, SP)  # first hit
    assert llm.engine.tiers.tier_stats()["host"].puts == 0
    llm.generate(p, SP)  # second hit: now worth keeping below
    assert llm.engine.tiers.tier_stats()["host"].puts > 0
    done(llm)


def test_salts_and_models_never_share_tier_entries(model_dir, tmp_path):
    p = prompts(12, 1)[0]
    llm = engine(model_dir, disk_cache_dir=str(tmp_path / "d"))
    llm.generate(p, SP, cache_salt="a")
    llm.engine.tiers.flush()
    done(llm)
    llm = engine(model_dir, disk_cache_dir=str(tmp_path / "d"))
    assert llm.generate(p, SP, cache_salt="b")[0].num_cached_tokens == 0
    assert llm.generate(p, SP, cache_salt="a")[0].cached_tokens_by_tier.get("disk") == 56
    done(llm)
    # another block size is another configuration: its fingerprint differs, nothing is found
    llm = engine(model_dir, block_size=8, num_device_blocks=20, disk_cache_dir=str(tmp_path / "d"))
    assert llm.generate(p, SP, cache_salt="a")[0].num_cached_tokens == 0
    done(llm)


def test_encryption_at_rest_per_tenant_and_destroyed_keys(model_dir, expected, tmp_path):
    pytest.importorskip("cryptography")
    from kvtier.tiers.crypto import KeyStore

    p = prompts(13, 1)[0]
    disk, keys = str(tmp_path / "d"), str(tmp_path / "keys")
    llm = engine(model_dir, disk_cache_dir=disk, kv_key_dir=keys)
    rid = llm.engine.add_request(p, SP, tenant="acme")
    while llm.engine.has_unfinished:
        llm.engine.step()
    llm.engine.tiers.flush()
    # the raw KV of a cached block appears in no file on disk
    node = next(iter(llm.engine.kv.index.nodes()))
    assert node.owner == Tenancy.of("acme")  # its owner id computed once, at add_request
    raw = llm.engine.runner.read_block(node.block_id).numpy().tobytes()
    files = sorted((tmp_path / "d").rglob("*.kv"))
    assert files and not any(raw[:256] in f.read_bytes() for f in files)
    done(llm)
    del rid

    def restore(**kw):
        e = engine(model_dir, disk_cache_dir=disk, kv_key_dir=keys, **kw)
        rid = e.engine.add_request(p, SP, tenant="acme")
        out = None
        while e.engine.has_unfinished:
            for o in e.engine.step():
                if o.request_id == rid and o.finished:
                    out = o
        stats = e.engine.tiers.tier_stats()["disk"]
        done(e)
        return out, stats

    out, _ = restore()
    assert out.cached_tokens_by_tier.get("disk") == 56 and out.outputs[0].token_ids == expected(p)
    assert KeyStore(keys).destroy("acme")
    out, stats = restore()  # every stored copy is now unreadable: a miss, recomputed correctly
    assert out.cached_tokens_by_tier.get("disk", 0) == 0 and out.outputs[0].token_ids == expected(p)
    assert stats.corrupt >= 1


def test_tenant_quotas_cap_host_and_disk_bytes_of_that_tenant_only(model_dir, expected, tmp_path):
    p = prompts(14, 1)[0]
    llm = engine(model_dir, host_cache_bytes=64 << 20, disk_cache_dir=str(tmp_path / "d"))
    eng = llm.engine
    bb = eng.runner.kv_bytes_per_block
    # a disk frame is a block plus a header, charged in whole file-system blocks: room for 8, not 9
    frame = encode(eng.runner.read_block(0), fingerprint=eng.runner.fingerprint, key=bytes(16))
    charge = eng.tiers.tiers["disk"].charged_bytes(len(frame))
    eng.tenants.set_quota("small", host_bytes=5 * bb, disk_bytes=8 * charge + charge // 2)
    for tenant in ("small", "big"):
        eng.add_request(p, SP, tenant=tenant, cache_salt=tenant)  # as the server does
        while eng.has_unfinished:
            eng.step()
    eng.tiers.flush()
    use_small, use_big = eng.tenants.usage("small"), eng.tenants.usage("big")
    assert use_small["host"]["blocks"] == 5 and use_small["disk"]["blocks"] == 8
    assert use_big["host"]["blocks"] == 16 and use_big["disk"]["blocks"] == 16
    assert eng.tiers.stats.quota_evictions == (16 - 5) + (16 - 8)
    done(llm)
