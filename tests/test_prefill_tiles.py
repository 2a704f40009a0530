"""triton_moe.tile_starts_reference (the torch ops the one-launch kernel is held to in tests/triton/test_prefill.py): the tile table of the grouped prompt kernel, built on the device without a host
sync — every entry of a group covered by exactly one tile of at most BT entries of that group, skipped
entries by none, and the table no larger than max_tiles says (the grid the kernel is launched with)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.runtime import triton_moe as tm


def _tiles_by_hand(seg: list[int], BT: int) -> list[int]:
    out, j = [], 0
    while j < len(seg):
        e = j
        while e < len(seg) and seg[e] == seg[j]:
            e += 1
        if seg[j] >= 0:
            out += list(range(j, e, BT))
        j = e
    return out


@pytest.mark.parametrize("BT", [1, 3, 16, 64])
@pytest.mark.parametrize("seed", range(6))
def test_tile_starts_cover_each_group_once(BT, seed):
    rng = np.random.default_rng((seed, BT))
    T, K, E = int(rng.integers(1, 200)), int(rng.integers(1, 9)), int(rng.integers(1, 40))
    K = min(K, E)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)])  # each token names K distinct experts
    slot_off = torch.from_numpy(ids * 4096)
    slot_off[torch.from_numpy(rng.random((T, K)) < 0.1)] = -1  # misses: skipped
    flat = slot_off.reshape(-1)
    seg = flat[torch.argsort(flat, stable=True)]
    J, groups = seg.numel(), min(T * K, E)
    n = tm.max_tiles(J, groups, BT)
    tlo = tm.tile_starts_reference(seg, BT, n)
    want = _tiles_by_hand(seg.tolist(), BT)
    assert len(want) <= n  # the bound holds
    assert tlo.tolist() == want + [-1] * (n - len(want))


def test_tile_starts_of_nothing_but_skipped_entries():
    seg = torch.full((5,), -1, dtype=torch.int64)
    assert tm.tile_starts_reference(seg, 4, tm.max_tiles(5, 5, 4)).tolist() == [-1] * tm.max_tiles(5, 5, 4)
