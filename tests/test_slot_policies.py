"""The runtime cache's slot policies (engine.runtime.slot_policies) on scripted uses: exact slots, evictions and
refusals; a prompt pass counted as its tokens one by one; the trace replay's policies driving the same classes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.routes.synthetic import QWEN3_30B_A3B
from engine.runtime.cache_policies import replay
from engine.runtime.slot_policies import SLOT_POLICIES, SlotDecayedLFU, SlotLRU, make_slots
from engine.runtime.slru import SegmentedLRU

F, T = False, True


def test_lru_slots_evict_the_least_recent_outside_the_working_set_and_pins():
    p = SlotLRU(2)
    assert p.admit((0, 1)) == (0, None) and p.admit((0, 2)) == (1, None)
    assert p.hit((0, 1)) == 0 and p.hit((0, 9)) is None
    assert p.admit((0, 3)) == (1, (0, 2))  # 2 is the least recent
    assert p.admit((0, 4), working_set=[(0, 1)]) == (1, (0, 3))  # 1 is older but in the working set
    p.pin((0, 4))
    assert p.admit((0, 5), working_set=[(0, 1)]) is None  # everything kept
    assert p.keys() == [(0, 1), (0, 4)] and len(p) == 2 and p.evictions == 2
    with pytest.raises(KeyError):
        p.admit((0, 1))


def test_dlfu_slots_refuse_a_weaker_miss_and_score_per_layer():
    p = SlotDecayedLFU(1, 2, 4, margin=0.0)
    p.observe(0, [[0]])
    assert p.admit((0, 0)) == (0, None)
    p.observe(0, [[0]])
    p.observe(1, [[2]])  # another layer's clock: layer 0's scores do not decay
    assert p.score()[0, 0] == pytest.approx(1 + 0.6 + 0.3 * 2 + (1 + 0.98) / 16 + (1 + 0.999) / 256)
    assert p.admit((1, 2)) is None  # used once: scores less than layer 0's expert 0, which stays
    assert p.keys() == [(0, 0)] and p.evictions == 0


def test_dlfu_window_keeps_an_expert_reused_a_few_tokens_back():
    # 1 slot: 0 used three times, then two one-offs. With the window count, 0 (3 uses in the last 8 tokens)
    # outscores each newcomer and is there when it comes back; without it, the decayed recency alone lets
    # the second one-off (2) in.
    trace = [[0], [0], [0], [1], [2], [0]]
    kw = dict(margin=0.0, freq_weight=0.0, long_weight=0.0)
    assert replay("dlfu", np.array(trace), 1, 4, **kw).ravel().tolist() == [F, T, T, F, F, T]
    assert replay("dlfu", np.array(trace), 1, 4, **kw, window_weight=0.0).ravel().tolist() == [F, T, T, F, F, F]
    with pytest.raises(TypeError, match="unknown dlfu knobs"):
        SlotDecayedLFU(1, 1, 4, decay=0.5)


@pytest.mark.parametrize("T_prompt", [3, 8, 20])
def test_a_prompt_pass_counts_as_its_tokens_one_by_one(T_prompt):
    rng = np.random.default_rng(T_prompt)
    ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(T_prompt + 5)])
    once, by_token = SlotDecayedLFU(4, 1, 16), SlotDecayedLFU(4, 1, 16)
    once.observe(0, ids[:T_prompt])
    for row in ids[:T_prompt]:
        by_token.observe(0, row[None])
    np.testing.assert_allclose(once.score(), by_token.score(), rtol=1e-12)
    for row in ids[T_prompt:]:  # and the window goes on from the same tokens
        once.observe(0, row[None])
        by_token.observe(0, row[None])
    np.testing.assert_allclose(once.score(), by_token.score(), rtol=1e-12)


def test_the_replays_lru_equals_the_runtimes_lru_slots_when_a_token_fits():
    """The trace replay's ``lru`` and the runtime's SlotLRU driven a token at a time (each expert in the router's
    order refreshed or admitted, the token the working set) keep the same experts whenever a token fits."""
    trace = replace(QWEN3_30B_A3B, n_layers=1).generate(prompt=32, decode=96, turns=1, seed=2)
    ids = trace.layer(0)
    for n_slots in (8, 26, 77):
        slots, got = SlotLRU(n_slots), []
        for row in ids:
            keys = [(0, int(e)) for e in row]
            hit = [k in slots for k in keys]
            for k, h in zip(keys, hit):
                slots.hit(k) if h else slots.admit(k, keys)
            got += hit
        assert got == replay("lru", ids, n_slots, 128).ravel().tolist(), n_slots


def test_make_slots_names_every_policy():
    for name in SLOT_POLICIES:
        p = make_slots(name, 3, 2, 8)
        assert p.name == name and p.n_slots == 3
        p.observe(1, np.array([[1, 2]]))
        assert p.admit((1, 1)) == (0, None)
    assert isinstance(make_slots("slru", 3, 2, 8), SegmentedLRU)
    with pytest.raises(ValueError, match="unknown cache policy"):
        make_slots("belady", 3, 2, 8)


def test_dlfu_keeps_its_own_copy_of_the_window():
    """The static step hands every token's routes in one reused buffer: the window must not see it change."""
    buf = np.zeros((1, 2), np.int64)
    reused, fresh = SlotDecayedLFU(2, 1, 8), SlotDecayedLFU(2, 1, 8)
    for row in ([0, 1], [2, 3], [4, 5]) * 4:
        buf[0] = row
        reused.observe(0, buf)
        fresh.observe(0, np.array([row]))
    np.testing.assert_array_equal(reused.in_window, fresh.in_window)
    np.testing.assert_allclose(reused.score(), fresh.score())
