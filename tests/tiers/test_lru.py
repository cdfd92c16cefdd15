"""ByteLRU, the byte-capacity LRU bookkeeping of the host, disk and simulated tiers: exact
entries, order and usage after each operation, and a model-based test against a plain list."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.tiers.lru import ByteLRU, LRUEntry


def filled(*items: tuple[str, int]) -> ByteLRU[str, str]:
    lru: ByteLRU[str, str] = ByteLRU()
    for key, nbytes in items:
        lru.insert(key, key.upper(), nbytes)
    return lru


def test_insert_orders_least_recent_first_and_sums_sizes() -> None:
    lru = filled(("a", 3), ("b", 5), ("c", 7))
    assert list(lru) == ["a", "b", "c"] and len(lru) == 3 and lru.usage_bytes == 15
    assert "b" in lru and "z" not in lru
    assert lru.peek("b") == LRUEntry("b", "B", 5)
    assert list(lru) == ["a", "b", "c"]  # peek keeps the order


def test_replace_moves_to_most_recent_and_returns_the_old_entry() -> None:
    lru = filled(("a", 3), ("b", 5))
    old = lru.insert("a", "A2", 10)
    assert old == LRUEntry("a", "A", 3)
    assert list(lru) == ["b", "a"] and lru.usage_bytes == 15 and lru.peek("a") == LRUEntry("a", "A2", 10)


def test_touch_makes_most_recent_and_misses_change_nothing() -> None:
    lru = filled(("a", 1), ("b", 1), ("c", 1))
    assert lru.touch("a") == LRUEntry("a", "A", 1)
    assert lru.touch("z") is None
    assert list(lru) == ["b", "c", "a"]


def test_pop_and_clear_free_their_bytes() -> None:
    lru = filled(("a", 2), ("b", 4))
    assert lru.pop("a") == LRUEntry("a", "A", 2) and lru.pop("a") is None
    assert lru.usage_bytes == 4
    assert lru.clear() == [LRUEntry("b", "B", 4)]
    assert len(lru) == 0 and lru.usage_bytes == 0


def test_evict_to_pops_least_recent_until_within_the_limit() -> None:
    lru = filled(("a", 4), ("b", 4), ("c", 4))
    assert lru.evict_to(12) == []  # already within
    assert [e.key for e in lru.evict_to(5)] == ["a", "b"]
    assert list(lru) == ["c"] and lru.usage_bytes == 4
    assert [e.key for e in lru.evict_to(-1)] == ["c"]  # nothing fits a negative limit
    assert lru.evict_to(-1) == [] and lru.usage_bytes == 0


def test_evict_to_never_takes_keep_and_leaves_its_place() -> None:
    lru = filled(("a", 4), ("b", 4), ("c", 4))
    assert [e.key for e in lru.evict_to(5, keep="a")] == ["b", "c"]
    assert list(lru) == ["a"] and lru.usage_bytes == 4
    lru = filled(("a", 4), ("b", 4), ("c", 4))
    assert [e.key for e in lru.evict_to(8, keep="a")] == ["b"]
    assert list(lru) == ["a", "c"]  # `keep` still least recent
    assert [e.key for e in lru.evict_to(0, keep="zz")] == ["a", "c"]  # an absent keep keeps nothing


def test_prefix_and_presence_counts() -> None:
    lru = filled(("a", 1), ("b", 1), ("d", 1))
    assert lru.count_prefix(["a", "b", "c", "d"]) == 2
    assert lru.count_prefix([]) == 0
    assert lru.count_present(["d", "c", "a"]) == 2
    assert list(lru) == ["a", "b", "d"]  # counting does not touch


def test_negative_size_is_refused() -> None:
    lru: ByteLRU[str, None] = ByteLRU()
    try:
        lru.insert("a", None, -1)
    except ValueError:
        pass
    else:
        raise AssertionError("a negative size must be refused")
    assert len(lru) == 0


KEYS = st.sampled_from("abcdefg")


class LRUMachine(RuleBasedStateMachine):
    """ByteLRU against a reference: a list of (key, nbytes), least recent first."""

    def __init__(self) -> None:
        super().__init__()
        self.lru: ByteLRU[str, int] = ByteLRU()
        self.model: list[tuple[str, int]] = []
        self.serial = 0

    def _find(self, key: str) -> int | None:
        return next((i for i, (k, _) in enumerate(self.model) if k == key), None)

    @rule(key=KEYS, nbytes=st.integers(0, 20))
    def insert(self, key: str, nbytes: int) -> None:
        self.serial += 1
        i = self._find(key)
        old = None if i is None else self.model.pop(i)
        got = self.lru.insert(key, self.serial, nbytes)
        assert (got is None) == (old is None)
        if got is not None and old is not None:
            assert (got.key, got.nbytes) == old
        self.model.append((key, nbytes))

    @rule(key=KEYS)
    def touch(self, key: str) -> None:
        i = self._find(key)
        got = self.lru.touch(key)
        assert (got is None) == (i is None)
        if i is not None:
            self.model.append(self.model.pop(i))

    @rule(key=KEYS)
    def pop(self, key: str) -> None:
        i = self._find(key)
        got = self.lru.pop(key)
        assert (got is None) == (i is None)
        if i is not None:
            assert got is not None and (got.key, got.nbytes) == self.model.pop(i)

    @rule(limit=st.integers(-5, 80), keep=st.none() | KEYS)
    def evict_to(self, limit: int, keep: str | None) -> None:
        expected: list[tuple[str, int]] = []
        usage = sum(n for _, n in self.model)
        for key, nbytes in list(self.model):
            if usage <= limit:
                break
            if key == keep:
                continue
            expected.append((key, nbytes))
            usage -= nbytes
        for item in expected:
            self.model.remove(item)
        assert [(e.key, e.nbytes) for e in self.lru.evict_to(limit, keep=keep)] == expected

    @rule(keys=st.lists(KEYS, max_size=6))
    def counts(self, keys: list[str]) -> None:
        present = {k for k, _ in self.model}
        prefix = next((i for i, k in enumerate(keys) if k not in present), len(keys))
        assert self.lru.count_prefix(keys) == prefix
        assert self.lru.count_present(keys) == sum(k in present for k in keys)

    @rule()
    def clear(self) -> None:
        assert [(e.key, e.nbytes) for e in self.lru.clear()] == self.model
        self.model = []

    @invariant()
    def matches_the_model(self) -> None:
        assert [(e.key, e.nbytes) for e in self.lru.entries()] == self.model
        assert list(self.lru) == [k for k, _ in self.model]
        assert self.lru.usage_bytes == sum(n for _, n in self.model)
        assert len(self.lru) == len(self.model)


LRUMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_lru_matches_reference = LRUMachine.TestCase
