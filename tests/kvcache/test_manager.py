"""KVCacheManager: exact block ids, reference counts and copies after each operation."""

from __future__ import annotations

import pytest

from kvtier.kvcache import KVCacheManager, chain_keys, root_key
from kvtier.sched.output import BlockCopy

BS = 4
ROOT = root_key(b"test-model")


def refs(m: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in m.pool.blocks if b.ref_cnt}


def snapshot(m: KVCacheManager) -> tuple:
    return (
        [(b.ref_cnt, b.key) for b in m.pool.blocks],
        list(m.pool._free),
        sorted(n.key for n in m.index.nodes()),
        m.live_references(),
        {r: list(s.block_ids) for r, s in m._reqs.items()},
        m.num_free_blocks,
    )


def admit(m: KVCacheManager, req_id: str, tokens: list[int], root: bytes = ROOT) -> list[int]:
    match = m.match(tokens, root)
    cached = match.num_cached_tokens(m.block_size)
    assert m.allocate_new(req_id, tokens, root, match, len(tokens) - cached)
    return m.block_ids(req_id)


def run(m: KVCacheManager, req_id: str, tokens: list[int]) -> None:
    """The step computed all of the request's tokens."""
    m.take_copies()
    m.end_step()
    m.cache_blocks(req_id, tokens, len(tokens))


T10 = list(range(1, 11))  # blocks [1 2 3 4][5 6 7 8][9 10]


def test_admit_cache_free_and_hit() -> None:
    m = KVCacheManager(8, BS)
    match = m.match(T10, ROOT)
    assert (match.block_ids, match.partial_src, match.num_cached_tokens(BS)) == ([], None, 0)
    assert admit(m, "a", T10) == [0, 1, 2]
    m.cache_blocks("a", T10, 10)
    k0, k1 = chain_keys(ROOT, T10, BS)
    assert [m.pool.blocks[b].key for b in range(3)] == [k0, k1, None]
    assert refs(m) == {0: 1, 1: 1, 2: 1} and m.num_free_blocks == 5
    m.check_integrity()

    m.free("a")
    assert refs(m) == {} and m.num_free_blocks == 8 and len(m.index) == 2
    m.check_integrity()

    match = m.match(T10, ROOT)
    assert (match.block_ids, match.keys, match.partial_src) == ([0, 1], [k0, k1], None)
    assert match.num_cached_tokens(BS) == 8
    assert m.allocate_new("b", T10, ROOT, match, 2)
    assert m.block_ids("b") == [0, 1, 2]  # the uncached block 2 went back to the free blocks
    assert refs(m) == {0: 1, 1: 1, 2: 1}
    assert (m.stats.hits_tokens, m.stats.queries_tokens, m.stats.hit_requests) == (8, 20, 1)
    assert [m.index.get(k).hits for k in (k0, k1)] == [1, 1]
    m.check_integrity()


def test_prompt_diverging_mid_block_copies_the_matching_tokens() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(1, 10))  # 9 tokens: two full blocks
    assert admit(m, "a", t) == [0, 1, 2]
    run(m, "a", t)
    m.free("a")

    u = [1, 2, 3, 4, 5, 6, 99, 98, 97, 96]  # shares 6 tokens: block 0 and half of block 1
    match = m.match(u, ROOT)
    assert (match.block_ids, match.partial_src, match.partial_tokens) == ([0], 1, 2)
    assert match.num_cached_tokens(BS) == 6
    assert m.allocate_new("b", u, ROOT, match, 4)
    assert m.block_ids("b") == [0, 2, 3]
    assert refs(m) == {0: 1, 1: 1, 2: 1, 3: 1}  # block 1 is locked for the copy
    assert m.num_free_blocks == 4
    m.check_integrity()

    assert m.take_copies() == [BlockCopy(src_block=1, dst_block=2, num_tokens=2)]
    assert m.take_copies() == []
    assert refs(m)[1] == 1  # still locked: the runner has not run the copy yet
    m.check_integrity()
    m.end_step()
    assert 1 not in refs(m) and m.index.is_evictable(m.pool.blocks[1].key)
    assert m.stats.partial_hit_tokens == 2
    m.check_integrity()

    m.cache_blocks("b", u, 10)  # b's own second block is registered next to block 1
    assert m.pool.blocks[2].key == chain_keys(ROOT, u, BS)[1]
    assert m.index.get(m.pool.blocks[0].key).num_children == 2
    m.check_integrity()


def test_fully_cached_prompt_of_whole_blocks_computes_its_last_token() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(1, 9))  # exactly 2 full blocks
    assert admit(m, "a", t) == [0, 1]
    run(m, "a", t)
    m.free("a")

    match = m.match(t, ROOT)
    assert (match.block_ids, match.partial_src, match.partial_tokens) == ([0], 1, 3)
    assert match.num_cached_tokens(BS) == 2 * BS - 1
    assert m.allocate_new("b", t, ROOT, match, 1)
    assert m.block_ids("b") == [0, 2]
    assert m.take_copies() == [BlockCopy(1, 2, 3)]
    m.end_step()
    m.check_integrity()
    assert m.match([5], ROOT).num_cached_tokens(BS) == 0
    assert m.match([1, 2], ROOT).num_cached_tokens(BS) == 1  # single partial token, never the last


def test_matched_prefix_survives_the_allocation_that_evicts_its_sibling() -> None:
    m = KVCacheManager(4, BS)
    t = list(range(1, 10))
    assert admit(m, "a", t) == [0, 1, 2]
    run(m, "a", t)
    m.free("a")  # free blocks 2, 3; cached: block 1 (leaf), block 0
    u = [1, 2, 3, 4] + [50] * 12  # hits block 0 only, needs 3 more blocks
    match = m.match(u, ROOT)
    assert match.block_ids == [0] and match.partial_src is None
    assert m.num_free_blocks == 4  # 2 empty + 2 evictable: exactly the 3 new blocks + the hit
    assert m.allocate_new("b", u, ROOT, match, 12)
    assert m.block_ids("b") == [0, 2, 3, 1] and m.num_free_blocks == 0
    assert len(m.index) == 1 and m.pool.num_evicted_blocks == 1
    m.check_integrity()


def test_allocate_new_and_allocate_more_fail_without_changing_state() -> None:
    m = KVCacheManager(4, BS)
    t = list(range(1, 10))
    assert admit(m, "a", t) == [0, 1, 2]
    run(m, "a", t)
    m.free("a")  # 2 empty blocks + 2 cached evictable ones
    u = t[:8] + list(range(20, 29))  # 17 tokens: 2 cached blocks + 3 new: one too many
    match = m.match(u, ROOT)
    assert match.block_ids == [0, 1] and m.num_free_blocks == 4
    before = snapshot(m)
    assert not m.allocate_new("b", u, ROOT, match, 9)  # 3 new + the 2 hits (evictable now) > 4
    assert snapshot(m) == before and not m.has_request("b")
    m.check_integrity()

    assert m.allocate_new("b", u[:16], ROOT, match, 8)  # 2 new + the 2 hits: matched evictable blocks count
    assert m.block_ids("b") == [0, 1, 2, 3] and m.num_free_blocks == 0
    before = snapshot(m)
    assert not m.allocate_more("b", 17)
    assert snapshot(m) == before
    assert m.allocate_more("b", 16)  # already fits
    m.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    m = KVCacheManager(8, BS)
    assert admit(m, "p", T10) == [0, 1, 2]
    run(m, "p", T10)
    assert m.fork("p", "c", 10)
    assert m.block_ids("c") == [0, 1, 3]
    assert refs(m) == {0: 2, 1: 2, 2: 2, 3: 1}  # block 2: parent + copy lock
    m.check_integrity()
    assert m.take_copies() == [BlockCopy(2, 3, 2)]
    m.end_step()
    assert refs(m) == {0: 2, 1: 2, 2: 1, 3: 1}
    assert m.fork("p", "d", 8)  # block boundary: nothing to copy
    assert m.block_ids("d") == [0, 1] and m.take_copies() == []
    assert refs(m) == {0: 3, 1: 3, 2: 1, 3: 1}
    m.check_integrity()
    m.free("p")
    assert refs(m) == {0: 2, 1: 2, 3: 1}
    m.check_integrity()
    # The child continues on its own tokens and registers its own third block.
    c = T10 + [11, 12]
    m.cache_blocks("c", c, 12)
    assert m.pool.blocks[3].key == chain_keys(ROOT, c, BS)[2]
    m.check_integrity()


def test_fork_fails_without_a_block_for_the_copy() -> None:
    m = KVCacheManager(3, BS)
    assert admit(m, "p", T10) == [0, 1, 2]
    run(m, "p", T10)
    before = snapshot(m)
    assert not m.fork("p", "c", 10)
    assert snapshot(m) == before
    assert m.fork("p", "c", 8)
    assert refs(m) == {0: 2, 1: 2, 2: 1}
    m.check_integrity()


def test_fork_before_the_parent_registers_its_blocks() -> None:
    m = KVCacheManager(8, BS)
    assert admit(m, "p", T10) == [0, 1, 2]
    m.take_copies()
    m.end_step()
    assert m.fork("p", "c", 8)  # the parent has not called cache_blocks yet
    m.cache_blocks("c", T10[:8], 8)  # the child registers the shared blocks first
    m.check_integrity()
    m.cache_blocks("p", T10, 10)
    assert len(m.index) == 2
    m.check_integrity()


def test_free_releases_pending_copy_locks() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(1, 10))
    admit(m, "a", t)
    run(m, "a", t)
    m.free("a")
    u = [1, 2, 3, 4, 5, 6, 99, 98]
    assert admit(m, "b", u) == [0, 2]
    assert refs(m) == {0: 1, 1: 1, 2: 1}
    m.free("b")
    assert refs(m) == {} and m.take_copies() == []
    assert m.num_free_blocks == 8
    m.check_integrity()


def test_free_during_a_step_keeps_the_in_flight_lock_until_end_step() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(1, 10))
    admit(m, "a", t)
    run(m, "a", t)
    m.free("a")
    assert admit(m, "b", [1, 2, 3, 4, 5, 6, 99, 98]) == [0, 2]
    assert m.take_copies() == [BlockCopy(1, 2, 2)]
    m.free("b")
    assert refs(m) == {1: 1}
    # The lock pins nothing it should not: block 0 (the source's parent) is pinned, not lost.
    assert m.num_free_blocks == 6
    m.check_integrity()
    m.end_step()
    assert refs(m) == {} and m.num_free_blocks == 8
    m.check_integrity()


def test_salts_isolate_requests() -> None:
    m = KVCacheManager(8, BS)
    alice, bob = root_key(b"test-model", "alice"), root_key(b"test-model", "bob")
    admit(m, "a", T10, alice)
    run(m, "a", T10)
    m.free("a")
    for root in (bob, ROOT, root_key(b"other-model", "alice")):
        match = m.match(T10, root)
        assert match.block_ids == [] and match.partial_src is None
    assert m.match(T10, alice).block_ids == [0, 1]
    assert admit(m, "b", T10, bob) == [2, 3, 4]
    run(m, "b", T10)
    assert len(m.index) == 4
    m.check_integrity()


def test_duplicate_registration_then_first_copy_evicted() -> None:
    m = KVCacheManager(9, BS)
    t = list(range(1, 10))
    assert admit(m, "a", t) == [0, 1, 2]
    assert admit(m, "b", t) == [3, 4, 5]  # admitted in the same step: nothing cached yet
    run(m, "a", t)
    run(m, "b", t)  # same keys: b's blocks stay uncached
    k = chain_keys(ROOT, t + [10, 11, 12], BS)
    assert [m.pool.blocks[b].key for b in (0, 1, 3, 4)] == [k[0], k[1], None, None]
    m.check_integrity()

    m.free("a")
    assert admit(m, "c", list(range(100, 124))) == [2, 6, 7, 8, 1, 0]  # free ones, then evicts a's copies
    assert len(m.index) == 0
    m.check_integrity()

    m.cache_blocks("b", t, 9)  # no new full block, but b re-registers its own copies
    assert [m.index.get(key).block_id for key in k[:2]] == [3, 4]
    m.check_integrity()

    t12 = t + [10, 11, 12]
    assert m.allocate_more("b", 12)
    m.cache_blocks("b", t12, 12)  # b falls back to its own copies, so the chain stays whole
    assert [m.index.get(key).block_id for key in k] == [3, 4, 5]
    m.check_integrity()
    assert m.match(t12 + [0], ROOT).block_ids == [3, 4, 5]


def test_duplicate_registration_under_a_freed_first_copy_pins_it() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(1, 10))
    assert admit(m, "a", t) == [0, 1, 2]
    assert admit(m, "b", t) == [3, 4, 5]
    run(m, "a", t)
    run(m, "b", t)
    m.free("a")  # a's blocks 0 and 1 are cached and evictable; 2 is free
    assert m.num_free_blocks == 5
    t12 = t + [10, 11, 12]
    m.cache_blocks("b", t12, 12)  # b's third block hangs under a's block 1
    k = chain_keys(ROOT, t12, BS)
    assert [m.index.get(key).block_id for key in k] == [0, 1, 5]
    assert m.num_free_blocks == 3 and m.pool.num_used_blocks == 5  # 0 and 1 are pinned
    m.check_integrity()

    before = snapshot(m)
    assert not m.allocate_more("b", 28)  # used to raise NoFreeBlocksError
    assert snapshot(m) == before
    assert m.allocate_more("b", 24)
    assert m.block_ids("b") == [3, 4, 5, 2, 6, 7]
    m.check_integrity()

    m.free("b")  # unpins 1 and 0 after 5
    assert m.num_free_blocks == 8
    m.check_integrity()
    assert admit(m, "c", list(range(100, 132))) == [2, 3, 4, 6, 7, 5, 1, 0]  # free ones, then leaf-first
    assert len(m.index) == 0
    m.check_integrity()


def test_stale_match_is_refused() -> None:
    m = KVCacheManager(4, BS)
    t = list(range(1, 10))
    admit(m, "a", t)
    run(m, "a", t)
    m.free("a")
    match = m.match(t, ROOT)
    assert match.block_ids == [0, 1]
    admit(m, "x", list(range(50, 66)))  # takes every block, evicting a's
    m.free("x")
    with pytest.raises(ValueError, match="stale PrefixMatch"):
        m.allocate_new("b", t, ROOT, match, 1)
    m.check_integrity()


def test_lfu_manager_keeps_the_most_hit_prefix() -> None:
    m = KVCacheManager(4, BS, eviction_policy="lfu")
    hot, cold = [1, 2, 3, 4, 0], [9, 9, 9, 9, 0]
    for i in range(3):
        admit(m, f"h{i}", hot)
        run(m, f"h{i}", hot)
        m.free(f"h{i}")
    admit(m, "c", cold)
    run(m, "c", cold)
    m.free("c")
    admit(m, "x", list(range(50, 61)))  # 3 blocks: two empty, then one eviction
    assert m.match(hot, ROOT).block_ids != [] and m.match(cold, ROOT).block_ids == []
    m.check_integrity()


def test_prefix_caching_disabled() -> None:
    m = KVCacheManager(8, BS, enable_prefix_caching=False)
    admit(m, "a", T10)
    run(m, "a", T10)
    assert len(m.index) == 0
    m.free("a")
    assert m.match(T10, ROOT).num_cached_tokens(BS) == 0
    m.check_integrity()
