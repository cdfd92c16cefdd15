"""PrefixIndex, block keys and eviction policies, without a pool."""

from __future__ import annotations

import pytest

from kvtier.kvcache import LFUPolicy, LRUPolicy, PrefixIndex, block_key, chain_keys, hash_id_key, make_policy, root_key

ROOT = root_key(b"test-model")


def insert_chain(
    index: PrefixIndex, blocks: list[list[int]], first_block_id: int = 0, root: bytes = ROOT
) -> list[bytes]:
    keys, parent = [], root
    for i, tokens in enumerate(blocks):
        key = block_key(parent, tokens)
        assert index.insert(key, parent, first_block_id + i, tokens, is_first=(i == 0)) is not None
        keys.append(key)
        parent = key
    return keys


# ---------------------------------------------------------------------- keys
def test_root_keys_separate_models_and_salts() -> None:
    roots = [
        root_key(b"m1"),
        root_key(b"m2"),
        root_key(b"m1", "alice"),
        root_key(b"m1", "bob"),
        root_key(b"m1", ""),
        root_key(b"m1\x01salt\x00x"),
        root_key(b"m1", "x"),
    ]
    assert len(set(roots)) == len(roots)
    assert root_key(b"m1", "alice") == root_key(b"m1", "alice")


def test_chain_keys_match_block_key_chain() -> None:
    tokens = list(range(11))
    k0 = block_key(ROOT, [0, 1, 2, 3])
    k1 = block_key(k0, [4, 5, 6, 7])
    assert chain_keys(ROOT, tokens, 4) == [k0, k1]  # the partial third block has no key
    assert chain_keys(k0, tokens, 4, start_block=1) == [k1]
    assert chain_keys(ROOT, tokens, 4, num_blocks=1) == [k0]
    assert block_key(ROOT, [0, 1, 2, 3]) != block_key(root_key(b"other"), [0, 1, 2, 3])
    assert hash_id_key(ROOT, 5) != hash_id_key(ROOT, 6) != hash_id_key(k0, 5)


# ---------------------------------------------------------------------- index
def test_insert_match_and_child_counts() -> None:
    index = PrefixIndex()
    k0, k1, k2 = insert_chain(index, [[1, 2], [3, 4], [5, 6]])
    assert [n.block_id for n in index.match_keys([k0, k1, k2, block_key(k2, [7, 8])])] == [0, 1, 2]
    assert [n.block_id for n in index.match_keys([k0, block_key(k0, [9, 9]), k2])] == [0]  # stops at a miss
    assert [index.get(k).num_children for k in (k0, k1, k2)] == [1, 1, 0]
    assert [index.is_leaf(k) for k in (k0, k1, k2)] == [False, False, True]
    assert index.get(k1).tokens == (3, 4) and index.get(k1).parent == k0
    assert index.get(k0).is_first and not index.get(k1).is_first
    assert len(index) == 3 and index.num_evictable == 0
    index.check_integrity()


def test_insert_refuses_duplicates_and_orphans() -> None:
    index = PrefixIndex()
    [k0] = insert_chain(index, [[1, 2]])
    assert index.insert(k0, ROOT, 9, [1, 2], is_first=True) is None
    assert index.get(k0).block_id == 0 and index.stats.duplicate_inserts == 1
    ghost = block_key(ROOT, [9, 9])
    assert index.insert(block_key(ghost, [1, 1]), ghost, 9, [1, 1], is_first=False) is None
    assert len(index) == 1
    index.check_integrity()


def test_best_partial_picks_the_child_sharing_most_leading_tokens() -> None:
    index = PrefixIndex()
    [k0] = insert_chain(index, [[1, 2, 3, 4]])
    index.insert(block_key(k0, [5, 6, 7, 8]), k0, 1, [5, 6, 7, 8], False)
    index.insert(block_key(k0, [5, 6, 9, 9]), k0, 2, [5, 6, 9, 9], False)
    index.insert(block_key(k0, [5, 0, 0, 0]), k0, 3, [5, 0, 0, 0], False)
    index.insert(hash_id_key(k0, 77), k0, 4, None, False)  # keys only: never a partial source
    hit = index.best_partial(k0, [5, 6, 9, 1])
    assert (hit.node.block_id, hit.num_tokens) == (2, 3)
    hit = index.best_partial(k0, [5, 6])
    assert hit.num_tokens == 2 and hit.node.block_id in (1, 2)
    assert index.best_partial(k0, [6, 6, 6, 6]) is None
    assert index.best_partial(k0, []) is None
    assert index.best_partial(ROOT, [1, 2, 0]).num_tokens == 2
    assert index.best_partial(root_key(b"test-model", "salt"), [1, 2, 0]) is None  # salts isolate
    index.check_integrity()


def test_salts_never_share_blocks() -> None:
    index = PrefixIndex()
    alice, bob = root_key(b"m", "alice"), root_key(b"m", "bob")
    ka = insert_chain(index, [[1, 2], [3, 4]], 0, root=alice)
    kb = chain_keys(bob, [1, 2, 3, 4], 2)
    assert index.match_keys(kb) == [] and not set(ka) & set(kb)
    kb = insert_chain(index, [[1, 2], [3, 4]], 2, root=bob)
    assert [n.block_id for n in index.match_keys(ka)] == [0, 1]
    assert [n.block_id for n in index.match_keys(kb)] == [2, 3]
    index.check_integrity()


def test_keys_only_trace_mode() -> None:
    """A trace of block hash ids drives the index without tokens."""
    index = PrefixIndex("lru")
    keys, parent = [], ROOT
    for i, hid in enumerate([11, 12, 13]):
        key = hash_id_key(parent, hid)
        node = index.insert(key, parent, i, None, is_first=(i == 0))
        assert node is not None and node.tokens is None
        keys.append(key)
        parent = key
    other = hash_id_key(keys[0], 99)
    index.insert(other, keys[0], 3, None, is_first=False)
    assert [n.block_id for n in index.match_keys(keys)] == [0, 1, 2]
    assert index.best_partial(keys[0], [1]) is None
    for k in (other, *reversed(keys)):
        index.set_evictable(k)
    index.check_integrity()
    victims = [index.evict_one().block_id for _ in range(4)]
    assert victims == [3, 2, 1, 0] and index.evict_one() is None
    index.check_integrity()


def test_pinning_follows_the_held_descendants() -> None:
    index = PrefixIndex("lru")
    k0, k1, k2 = insert_chain(index, [[1, 2], [3, 4], [5, 6]])
    index.set_evictable(k0)
    index.set_evictable(k1)
    assert index.num_evictable == 0  # pinned by k2, still in use
    assert index.evict_one() is None and index.remove_evictable(k1) is None
    index.check_integrity()
    index.set_evictable(k2)  # the whole chain becomes evictable, parents after children
    assert [index.is_evictable(k) for k in (k0, k1, k2)] == [True, True, True]
    index.set_in_use(k2)  # a hit on the leaf pins its ancestors again
    assert [index.is_evictable(k) for k in (k0, k1, k2)] == [False, False, False]
    index.set_in_use(k0)
    index.set_evictable(k2)
    assert [index.is_evictable(k) for k in (k0, k1, k2)] == [False, True, True]
    index.check_integrity()
    index.set_evictable(k0)
    assert [index.evict_one().block_id for _ in range(3)] == [2, 1, 0]
    assert index.stats.evictions == 3
    index.check_integrity()


def test_insert_under_an_evictable_parent_pins_it() -> None:
    index = PrefixIndex()
    [k0] = insert_chain(index, [[1, 2]])
    index.set_evictable(k0)
    assert index.is_evictable(k0)
    k1 = block_key(k0, [3, 4])
    index.insert(k1, k0, 1, [3, 4], False)  # in use by the request that computed it
    assert not index.is_evictable(k0) and index.get(k0).num_held_children == 1
    index.check_integrity()


def test_check_integrity_catches_a_wrong_child_count() -> None:
    index = PrefixIndex()
    k0, _ = insert_chain(index, [[1, 2], [3, 4]])
    index.get(k0).num_children = 0
    with pytest.raises(AssertionError):
        index.check_integrity()


# ---------------------------------------------------------------------- policies
def test_lru_policy_order_and_leaf_filter() -> None:
    p = LRUPolicy()
    for k in (b"a", b"b", b"c"):
        p.add(k, 0)
    p.add(b"a", 0)  # re-adding makes it recent
    p.remove(b"zz")  # absent: no-op
    assert len(p) == 3 and b"b" in p
    assert p.pop_victim(lambda k: k != b"b") == b"c"
    assert b"b" in p and len(p) == 2  # skipped keys stay
    assert p.pop_victim(lambda k: False) is None
    assert p.pop_victim(lambda k: True) == b"b"


def test_lfu_policy_order_and_leaf_filter() -> None:
    p = LFUPolicy()
    p.add(b"a", 3)
    p.add(b"b", 1)
    p.add(b"c", 1)
    p.add(b"d", 0)
    p.remove(b"d")
    assert len(p) == 3 and b"d" not in p
    assert p.pop_victim(lambda k: k != b"b") == b"c"
    assert b"b" in p and p.pop_victim(lambda k: True) == b"b"
    p.add(b"a", 0)  # re-added with fewer hits: the old entry is stale
    p.add(b"e", 1)
    assert p.pop_victim(lambda k: True) == b"a"
    assert p.pop_victim(lambda k: True) == b"e"
    assert p.pop_victim(lambda k: True) is None and len(p) == 0


def test_lfu_policy_drops_stale_entries() -> None:
    p = LFUPolicy()
    for i in range(1000):
        p.add(i.to_bytes(4, "little"), i)
        p.remove(i.to_bytes(4, "little"))
    assert len(p) == 0 and len(p._heap) < 200


def test_make_policy() -> None:
    assert make_policy("lru").name == "lru" and make_policy("lfu").name == "lfu"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")
