"""BlockPool: exact block ids and reference counts after each operation."""

from __future__ import annotations

import pytest

from kvtier.kvcache import BlockPool, NoFreeBlocksError, PrefixIndex, block_key, root_key

ROOT = root_key(b"test-model")


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def cache_chain(
    pool: BlockPool, block_ids: list[int], first_token: int = 1, bs: int = 2, root: bytes = ROOT
) -> list[bytes]:
    """Register `block_ids` as one chain of full blocks; returns their keys."""
    keys, parent = [], root
    for i, b in enumerate(block_ids):
        tokens = [first_token + i * bs + j for j in range(bs)]
        key = block_key(parent, tokens)
        assert pool.cache_block(b, key, parent, tokens, is_first=(i == 0))
        keys.append(key)
        parent = key
    return keys


def test_allocate_takes_the_lowest_free_ids_so_a_request_gets_ascending_blocks() -> None:
    pool = BlockPool(4, PrefixIndex())
    assert pool.allocate(2) == [0, 1]
    assert refs(pool) == [1, 1, 0, 0]
    assert pool.allocate(1) == [2]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    pool.free_blocks([0, 1])  # freed in any order, handed out lowest id first
    assert refs(pool) == [0, 0, 1, 0]
    assert pool.allocate(3) == [0, 1, 3]
    assert refs(pool) == [1, 1, 1, 1]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4, PrefixIndex())
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert refs(pool) == [1, 1, 1, 0]
    assert pool.allocate(1) == [3]
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_ref_and_free_errors() -> None:
    pool = BlockPool(2, PrefixIndex())
    with pytest.raises(ValueError):
        pool.ref(0)  # free blocks must be allocated, not referenced
    with pytest.raises(ValueError):
        pool.free_block(1)
    with pytest.raises(ValueError):
        BlockPool(0)
    [b] = pool.allocate(1)
    pool.ref(b)
    assert refs(pool) == [2, 0]
    pool.free_block(b)
    pool.free_block(b)
    assert refs(pool) == [0, 0] and pool.num_free_blocks == 2
    pool.check_integrity({})


def test_free_blocks_are_taken_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(4, PrefixIndex("lru"))
    assert pool.allocate(2) == [0, 1]
    k0, k1 = cache_chain(pool, [0, 1])
    pool.free_blocks([0, 1])
    assert refs(pool) == [0, 0, 0, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.index.num_evictable) == (4, 0, 2)
    pool.check_integrity({})

    assert pool.allocate(2) == [2, 3]  # the empty blocks first
    assert k0 in pool.index and k1 in pool.index and pool.num_evicted_blocks == 0
    pool.check_integrity({2: 1, 3: 1})

    assert pool.allocate(1) == [1]  # now the cached leaf
    assert k1 not in pool.index and k0 in pool.index and pool.blocks[1].key is None
    assert pool.num_evicted_blocks == 1
    pool.check_integrity({1: 1, 2: 1, 3: 1})

    assert pool.allocate(1) == [0]
    assert len(pool.index) == 0 and pool.num_evicted_blocks == 2
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_freed_cached_block_is_hit_again() -> None:
    pool = BlockPool(4, PrefixIndex())
    assert pool.allocate(1) == [0]
    [k0] = cache_chain(pool, [0])
    pool.free_block(0)
    assert pool.index.is_evictable(k0) and pool.num_free_blocks == 4
    assert pool.allocate(2) == [1, 2]  # does not touch the cached block
    [node] = pool.index.match_keys([k0])
    assert node.block_id == 0
    pool.ref(node.block_id)  # the hit
    assert refs(pool) == [1, 1, 1, 0]
    assert not pool.index.is_evictable(k0) and pool.num_free_blocks == 1
    pool.check_integrity({0: 1, 1: 1, 2: 1})
    pool.free_block(0)
    assert pool.index.is_evictable(k0) and pool.blocks[0].key == k0
    pool.check_integrity({1: 1, 2: 1})


def test_lru_evicts_the_least_recently_freed_leaf() -> None:
    pool = BlockPool(3, PrefixIndex("lru"))
    assert pool.allocate(3) == [0, 1, 2]
    keys = [cache_chain(pool, [b], first_token=10 * b)[0] for b in range(3)]
    for b in (1, 0, 2):
        pool.free_block(b)
    pool.check_integrity({})
    assert pool.allocate(1) == [1]
    assert keys[1] not in pool.index
    assert pool.allocate(1) == [0]
    assert pool.allocate(1) == [2]
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_lru_hit_makes_a_block_recent_again() -> None:
    pool = BlockPool(2, PrefixIndex("lru"))
    assert pool.allocate(2) == [0, 1]
    cache_chain(pool, [0], first_token=0)
    cache_chain(pool, [1], first_token=10)
    pool.free_block(0)
    pool.free_block(1)
    pool.ref(0)  # hit on the older one
    pool.free_block(0)
    assert pool.allocate(1) == [1]
    pool.check_integrity({1: 1})


def test_lfu_evicts_the_least_hit_then_the_least_recently_freed() -> None:
    pool = BlockPool(4, PrefixIndex("lfu"))
    assert pool.allocate(4) == [0, 1, 2, 3]
    for b in range(4):
        cache_chain(pool, [b], first_token=10 * b)
    hits = {0: 2, 1: 0, 2: 1, 3: 0}
    for b, n in hits.items():
        for _ in range(n):
            pool.index.record_hit(pool.index.get(pool.blocks[b].key))
    for b in (3, 0, 1, 2):  # 3 and 1 tie at 0 hits; 3 was freed first
        pool.free_block(b)
    pool.check_integrity({})
    assert [pool.allocate(1)[0] for _ in range(4)] == [3, 1, 2, 0]
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("free_order", [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]])
def test_eviction_takes_leaves_before_parents(policy: str, free_order: list[int]) -> None:
    pool = BlockPool(5, PrefixIndex(policy))
    assert pool.allocate(4) == [0, 1, 2, 3]
    keys = cache_chain(pool, [0, 1, 2, 3])
    live = {0: 1, 1: 1, 2: 1, 3: 1}
    for b in free_order:
        pool.free_block(b)
        del live[b]
        pool.check_integrity(live)
        # A freed block under a still-used child is pinned, not free: it could not be evicted.
        assert pool.num_free_blocks == 1 + sum(1 for c in range(4) if all(d not in live for d in range(c, 4)))
    assert pool.allocate(1) == [4]
    live[4] = 1
    evicted = []
    for _ in range(4):
        before = {n.key: n.num_children for n in pool.index.nodes()}
        [b] = pool.allocate(1)
        live[b] = 1
        [victim] = set(before) - {n.key for n in pool.index.nodes()}
        assert before[victim] == 0, "evicted a block that still had a cached child"
        evicted.append(b)
        pool.check_integrity(live)
    assert evicted == [3, 2, 1, 0]
    assert len(pool.index) == 0 and keys


def test_a_freed_parent_under_a_used_child_is_pinned_not_free() -> None:
    pool = BlockPool(3, PrefixIndex())
    assert pool.allocate(2) == [0, 1]
    k0, k1 = cache_chain(pool, [0, 1])
    pool.free_block(0)  # the child (block 1) is still in use
    assert not pool.index.is_evictable(k0)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 2)
    assert pool.allocate(1) == [2]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert k0 in pool.index
    pool.check_integrity({1: 1, 2: 1})
    pool.ref(0)  # a hit on the pinned block makes it used again
    pool.free_block(0)
    pool.free_block(1)  # now the whole chain is evictable, leaf first
    assert pool.index.is_evictable(k0) and pool.index.is_evictable(k1) and pool.num_free_blocks == 2
    pool.check_integrity({2: 1})
    assert pool.allocate(2) == [1, 0]  # no free block left: the index evicts leaf first
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_duplicate_key_leaves_the_second_block_uncached() -> None:
    pool = BlockPool(3, PrefixIndex())
    assert pool.allocate(2) == [0, 1]
    [k0] = cache_chain(pool, [0])
    assert not pool.cache_block(1, k0, ROOT, [1, 2], is_first=True)
    assert pool.blocks[1].key is None and pool.index.get(k0).block_id == 0
    assert pool.index.stats.duplicate_inserts == 1
    pool.free_blocks([0, 1])
    assert pool.allocate(1) == [1]  # block 1 went to the free queue, block 0 stays cached
    assert pool.allocate(1) == [2]
    assert pool.index.get(k0).block_id == 0
    pool.check_integrity({1: 1, 2: 1})


def test_cache_block_under_an_uncached_parent_is_refused() -> None:
    pool = BlockPool(2, PrefixIndex())
    [b] = pool.allocate(1)
    orphan_parent = block_key(ROOT, [7, 7])
    assert not pool.cache_block(b, block_key(orphan_parent, [1, 2]), orphan_parent, [1, 2], is_first=False)
    assert pool.blocks[b].key is None and len(pool.index) == 0
    pool.check_integrity({b: 1})


def test_evict_cached_purges_only_unreferenced_leaves() -> None:
    pool = BlockPool(3, PrefixIndex())
    assert pool.allocate(2) == [0, 1]
    k0, k1 = cache_chain(pool, [0, 1])
    assert not pool.evict_cached(k1)  # referenced
    pool.free_blocks([0, 1])
    assert not pool.evict_cached(k0)  # has a child
    assert pool.evict_cached(k1) and pool.evict_cached(k0)
    assert len(pool.index) == 0 and pool.num_free_blocks == 3
    assert pool.allocate(3) == [0, 1, 2]
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_pool_without_index() -> None:
    pool = BlockPool(2)
    assert pool.allocate(2) == [0, 1]
    assert not pool.cache_block(0, block_key(ROOT, [1, 2]), ROOT, [1, 2], is_first=True)
    pool.free_blocks([0, 1])
    assert pool.allocate(2) == [0, 1]
    pool.check_integrity({0: 1, 1: 1})


def test_check_integrity_catches_wrong_ref_counts_and_lost_blocks() -> None:
    pool = BlockPool(3, PrefixIndex())
    pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity({0: 1})  # block 1 has a reference nobody holds
    pool.blocks[1].ref_cnt = 0  # lost: unreferenced, uncached, not in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity({0: 1})


def test_blocks_freed_in_any_order_come_back_ascending() -> None:
    """After evictions and resets return blocks scattered, a new request's table is still
    ascending (the decode kernel streams adjacent blocks; see BlockPool's module docstring)."""
    pool = BlockPool(16, PrefixIndex())
    pool.allocate(16)
    for b in [9, 3, 15, 0, 7, 12, 1, 4]:
        pool.free_block(b)
    assert pool.allocate(5) == [0, 1, 3, 4, 7]
    assert pool.allocate(3) == [9, 12, 15]
    pool.check_integrity({b: 1 for b in range(16)})
