"""SegmentedLRU on scripted traces: promotion, demotion, eviction order, pinning, working set."""

from __future__ import annotations

import pytest

from engine.runtime.slru import SegmentedLRU


def test_admit_fills_free_slots_then_evicts_probationary_lru():
    c = SegmentedLRU(4)  # 1 probationary, 3 protected
    assert [c.admit(k)[0] for k in "abcd"] == [0, 1, 2, 3]
    assert c.protected_cap == 3
    assert c.admit("e") == (0, "a")  # a: least recent probationary entry
    assert "a" not in c and c.slot("e") == 0 and c.evictions == 1


def test_second_hit_promotes_and_protected_overflow_demotes_its_lru():
    c = SegmentedLRU(4)
    for k in "abcd":
        c.admit(k)
    assert c.hit("zz") is None
    for k in "abc":
        assert c.hit(k) == c.slot(k)  # promoted to protected (cap 3)
    assert list(c.protected) == ["a", "b", "c"] and list(c.probation) == ["d"]
    c.hit("d")  # promotes d; protected overflows; its LRU (a) is demoted
    assert list(c.protected) == ["b", "c", "d"] and list(c.probation) == ["a"]
    c.hit("b")  # a hit in protected refreshes recency only
    assert list(c.protected) == ["c", "d", "b"]
    assert c.admit("e") == (0, "a")  # the demoted entry goes first


def test_working_set_and_pins_are_never_evicted():
    c = SegmentedLRU(3)
    for k in "abc":
        c.admit(k)
    c.pin("a")
    slot, victim = c.admit("d", working_set={"b"})
    assert victim == "c"  # a pinned, b in the working set
    c.hit("d")
    assert c.admit("e", working_set={"b", "d"}) is None  # everything left is protected
    c.unpin("a")
    assert c.admit("e", working_set={"b", "d"})[1] == "a"


def test_eviction_falls_back_to_protected_segment():
    c = SegmentedLRU(2)
    c.admit("a")
    c.admit("b")
    c.hit("a")  # a protected, b probationary
    assert c.admit("c", working_set={"b"}) == (c.slot("c"), "a")


def test_single_slot_is_plain_lru_and_errors():
    c = SegmentedLRU(1)
    c.admit("a")
    c.hit("a")
    assert c.admit("b") == (0, "a")
    with pytest.raises(KeyError):
        c.admit("b")
    assert SegmentedLRU(0).admit("x") is None
